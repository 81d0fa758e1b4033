"""Decides whether a file's bytes are a usable image, without decoding unless asked.

The default "header" check is cheap enough to keep packing I/O-bound: it sniffs the
format from the magic bytes, parses the header (JPEG markers up to the first scan, PNG
IHDR, or Pillow's lazy header parse for the rest) and, for JPEG and PNG, looks for the
end marker, which is what a truncated copy loses. "full" decodes every pixel, JPEGs with
libjpeg-turbo in strict mode, which reports corrupt scan data that Pillow greys over.

Both levels refuse an image whose header claims more than max_pixels pixels, before any
pixel is decoded: a few KB of JPEG can claim 60000x60000, which takes gigabytes and tens
of seconds to decode (a decompression bomb). The default, MAX_PIXELS, is the limit above
which Pillow itself refuses to open an image, so packer accepts exactly what Pillow and
torchvision's loader open by default; readers.decode applies the same limit.
"""
from __future__ import annotations

import io
import struct
import warnings

CHECKS = ("header", "full", "none")
# Pillow's default DecompressionBombError threshold: 2 x PIL.Image.MAX_IMAGE_PIXELS, which is
# 1 GiB // 4 // 3 = 89,478,485. A constant, not read from Pillow: the header check of a JPEG or
# PNG never imports Pillow, and a caller may have changed Pillow's setting for its own reasons.
MAX_PIXELS = 178_956_970

# The image file suffixes torchvision's ImageFolder takes (scan.py lists files by them; a
# WebDataset member is an image by them).
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")
IMAGE_EXTENSIONS = tuple("." + suffix for suffix in IMAGE_SUFFIXES)
JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# JPEG colour spaces libjpeg-turbo (simplejpeg) decodes to RGB as Pillow does; CMYK and
# YCCK go through Pillow's converter.
TURBO_COLORSPACES = ("YCbCr", "Gray", "RGB")
# Markers that carry no length field: TEM, RST0-7, SOI, EOI.
_STANDALONE = {0x01, *range(0xD0, 0xD8), 0xD8, 0xD9}
# Start-of-frame markers (SOF0-SOF15 less DHT C4, JPG C8, DAC CC): the frame header with the size.
SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
SOS = 0xDA  # start of scan


def sniff(data: bytes) -> str | None:
    """The image format named by the magic bytes, or None."""
    if data.startswith(JPEG_MAGIC):
        return "jpeg"
    if data.startswith(PNG_MAGIC):
        return "png"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\0", b"MM\0*"):
        return "tiff"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if len(data) >= 2 and data[0:1] == b"P" and data[1:2] in b"123456":
        return "pnm"
    return None


def problem(data: bytes, level: str = "header", max_pixels: int = MAX_PIXELS) -> str | None:
    """Why data is not a usable image, or None when it is.

    Args:
        max_pixels: refuse an image whose header claims more pixels than this.
    """
    if level == "none":
        return None
    if not data:
        return "empty file (0 bytes)"
    kind = sniff(data)
    if kind is None:
        return f"not an image (starts with {bytes(data[:8])!r}; expected JPEG, PNG, BMP, TIFF, WebP or PNM)"
    if kind == "jpeg":
        reason = jpeg_problem(data, max_pixels)
    elif kind == "png":
        reason = png_problem(data, max_pixels)
    else:
        reason = None
    if reason is None and level == "full" and kind == "jpeg":
        reason = strict_jpeg_problem(data, max_pixels)
    elif reason is None and (level == "full" or kind not in ("jpeg", "png")):
        reason = pillow_problem(data, level == "full", max_pixels)
    return reason


def size_problem(width: int, height: int, max_pixels: int) -> str | None:
    """Why an image of this claimed size is refused before decoding, or None.

    The reason ends where the caller adds how to raise the limit (--max-pixels when
    packing, max_pixels= when reading).
    """
    if width * height <= max_pixels:
        return None
    return (f"image too large: its header claims {width}x{height} = {width * height:,} pixels, over the "
            f"limit of {max_pixels:,} (a guard against decompression bombs)")


def too_large(reason: str) -> str:
    return f"{reason}; if the image is genuine, raise the limit with --max-pixels"


def jpeg_segments(data: bytes):
    """(marker, start, end) of each JPEG marker segment from SOI up to the first SOS, in
    order: data[start:end] is its payload (end may run past the data when it is cut short).

    Stops where the data ends; raises ValueError with the reason on a byte that is no marker.
    The header check (jpeg_problem) and packer.jpeg_form both read headers through it.
    """
    pos, n = 2, len(data)
    while pos < n:
        if data[pos] != 0xFF:
            raise ValueError(f"corrupt JPEG (no marker at byte {pos})")
        if pos + 1 >= n:
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if pos + 4 > n:
            return
        (length,) = struct.unpack_from(">H", data, pos + 2)
        yield marker, pos + 4, pos + 2 + length
        if marker == SOS:
            return
        pos += 2 + length


def jpeg_problem(data: bytes, max_pixels: int = MAX_PIXELS) -> str | None:
    size_seen = False
    try:
        for marker, start, end in jpeg_segments(data):
            if marker in SOF_MARKERS:
                if start + 5 > len(data):
                    break
                height, width = struct.unpack_from(">HH", data, start + 1)
                if data[start] != 8:
                    return precision_problem(data[start])
                if width == 0:
                    return "corrupt JPEG (zero width in frame header)"
                if (reason := size_problem(width, height, max_pixels)) is not None:
                    return too_large(reason)
                size_seen = True
            if marker == SOS:  # entropy data follows; EOI must come after it
                if not size_seen:
                    return "corrupt JPEG (scan before frame header)"
                # Entropy-coded data never contains FF D9 (FF is always stuffed), so an EOI
                # after the first scan exists exactly when the file was not cut short.
                if data.rfind(b"\xff\xd9", start - 4) == -1:
                    return "truncated JPEG (no end-of-image marker)"
                return None
    except ValueError as exc:
        return str(exc)
    return "truncated JPEG (ends inside the header)"


def unusual_precision(data: bytes) -> str | None:
    """precision_problem() for a JPEG whose frame header gives other than 8-bit samples,
    else None: what a decoder's failure on it means, in packer's words."""
    if not data.startswith(JPEG_MAGIC):
        return None
    try:
        for marker, start, _ in jpeg_segments(data):
            if marker in SOF_MARKERS:
                return precision_problem(data[start]) if start < len(data) and data[start] != 8 else None
    except ValueError:
        return None
    return None


def precision_problem(bits: int) -> str:
    """Why a JPEG of other than 8-bit samples is refused: neither libjpeg-turbo's 8-bit
    decoder (simplejpeg, Pillow, torchvision, DALI) nor packer can decode it, so it can be
    neither stored for the readers nor re-encoded."""
    return (f"{bits}-bit JPEG (sample precision {bits}): packer and its readers decode 8-bit JPEGs only; "
            "convert it to an 8-bit JPEG or PNG (for example with ImageMagick: `magick IN -depth 8 OUT.jpg`), "
            "or leave it out of SRC")


def png_problem(data: bytes, max_pixels: int = MAX_PIXELS) -> str | None:
    if len(data) < 33 or data[12:16] != b"IHDR":
        return "truncated PNG (no IHDR header)"
    width, height = struct.unpack_from(">II", data, 16)
    if width == 0 or height == 0:
        return "corrupt PNG (zero size in IHDR)"
    if (reason := size_problem(width, height, max_pixels)) is not None:
        return too_large(reason)
    if data.rfind(b"IEND", max(0, len(data) - 64)) == -1:
        return "truncated PNG (no IEND chunk)"
    return None


def strict_jpeg_problem(data: bytes, max_pixels: int = MAX_PIXELS, scaled: bool = False) -> str | None:
    """Decode with libjpeg-turbo in strict mode: unlike Pillow, it reports corrupt scan
    data (which libjpeg otherwise papers over with grey) instead of warning. scaled: decode
    at 1/8 of the size (DCT scaling), which reads every bit of the scan data all the same,
    for a caller that only needs the verdict.

    The caller has checked the size in the frame header (jpeg_problem).
    """
    import simplejpeg

    try:
        colorspace = simplejpeg.decode_jpeg_header(data)[2]
        if colorspace not in TURBO_COLORSPACES:
            return pillow_problem(data, True, max_pixels)
        smallest = {"min_width": 1, "min_height": 1} if scaled else {}
        simplejpeg.decode_jpeg(data, strict=True, **smallest)
    except ValueError as exc:
        return f"corrupt JPEG ({exc})"
    return None


def pillow_problem(data: bytes, decode: bool, max_pixels: int = MAX_PIXELS) -> str | None:
    """Open with Pillow (header only), refuse an oversized image, then decode if asked."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # The size is checked against max_pixels below, before decoding: that is the policy,
            # and Pillow's DecompressionBombWarning (at half its own limit) would only repeat it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # Pillow's other warnings (odd EXIF, unknown TIFF tags) do not make an image unusable.
            warnings.simplefilter("ignore", UserWarning)
            with open_lazily(data, max_pixels) as im:
                reason = size_problem(im.width, im.height, max_pixels)
                if reason is not None:
                    return too_large(reason)
                if decode:
                    im.load()
                    im.convert("RGB")
    except Image.DecompressionBombError as exc:
        return too_large(pillow_refusal(exc, max_pixels))
    except Exception as exc:  # Pillow raises many types for bad data; all mean the same here
        return f"cannot decode image ({type(exc).__name__}: {exc})"
    return None


def open_lazily(data: bytes, max_pixels: int):
    """PIL.Image.open(data): the header is parsed, no pixel is decoded.

    Pillow enforces its own limit when it opens an image, and again when it loads TIFF
    tiles or GIF frames: it warns above Image.MAX_IMAGE_PIXELS and refuses above twice
    that. A max_pixels raised above the default raises Image.MAX_IMAGE_PIXELS to it
    (never lowers it), for the process: the caller asked for such images, and Pillow's
    limit is a process-wide setting with no per-call form.
    """
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if max_pixels > MAX_PIXELS and limit is not None and limit < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels
    return Image.open(io.BytesIO(data))


def pillow_refusal(exc: Exception, max_pixels: int) -> str:
    """The reason for an image Pillow refused to open as too large (its message gives the size).

    Unless Pillow's limit was lowered by the caller, the image is over max_pixels too,
    since open_lazily keeps Pillow's limit at or above it.
    """
    return f"image too large: Pillow refuses it ({exc}); packer's limit is {max_pixels:,} pixels"


def packed_max_pixels(params: dict) -> int:
    """The pixel limit a dataset was packed with (its metadata params), else MAX_PIXELS."""
    value = params.get("max_pixels")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else MAX_PIXELS
