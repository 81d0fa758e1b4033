"""Opt-in re-encoding at a bounded resolution: the images `pack --max-side` and `convert --max-side` shrink.

Decoding is what bounds training throughput once records are packed, and its cost grows
with the pixels stored: storing images at a bounded long side is how FFCV speeds up
ImageNet training (docs/resolution.md has the measured gain and the accuracy trade-off).

The rule is a pure function of the source image, so verify can re-derive it: an image is
re-encoded if and only if its upright long side (after its EXIF orientation) is over
max_side. Every other image is stored byte for byte, exactly as without the option. A
re-encoded image is:
  - decoded (JPEG through libjpeg's DCT scaling down to at least twice the target size,
    as Pillow's thumbnail() does, so the final filter still sees the detail), CMYK and
    palette/alpha images converted to RGB as the readers convert them, grayscale kept
    grayscale;
  - resized with Lanczos so its long side is max_side and its aspect ratio kept (short
    side rounded, at least 1 pixel: target_size);
  - turned upright by its EXIF orientation (after resizing: a lossless transpose of fewer
    pixels), so the stored pixels are upright and carry no orientation tag;
  - encoded as baseline JPEG at `quality` with 4:2:0 chroma subsampling (libjpeg-turbo,
    through simplejpeg), whatever the source format (a PNG over the limit becomes a JPEG;
    the record keeps its source path, which is its identity).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .check import MAX_PIXELS, open_lazily, size_problem
from .errors import BadImageError, PackError

DEFAULT_QUALITY = 90  # FFCV's default JPEG quality for its ImageNet datasets
MAX_SIDE_LIMIT = 65535  # JPEG's largest dimension
EXIF_ORIENTATION = 0x0112
# Fetch at least this multiple of the target size from the DCT-scaled decode (Pillow's
# thumbnail default): DCT scaling is a crude filter, Lanczos from 2x or more is not.
DRAFT_GAP = 2
# Orientation tag -> the PIL.Image.Transpose that makes the pixels upright (EXIF 2.3).
_UPRIGHT = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
            7: "TRANSVERSE", 8: "ROTATE_90"}
_SWAPS_SIDES = frozenset({5, 6, 7, 8})


@dataclass(frozen=True)
class Reencode:
    """What to re-encode (images whose upright long side is over max_side) and how (JPEG quality)."""

    max_side: int
    quality: int = DEFAULT_QUALITY

    def record(self, counts: dict[str, int]) -> dict:
        """The metadata's "reencode" object (packer.records checks it when read)."""
        return {"max_side": self.max_side, "quality": self.quality, "counts": dict(counts)}


def reencode_spec(max_side: int | None, quality: int | None) -> Reencode | None:
    """The checked Reencode for pack()/convert() arguments, or None when max_side is None."""
    if max_side is None:
        if quality is not None:
            raise PackError("quality applies to re-encoded images: pass max_side too")
        return None
    if isinstance(max_side, bool) or not isinstance(max_side, int) or not 1 <= max_side <= MAX_SIDE_LIMIT:
        raise PackError(f"max_side must be a whole number of pixels from 1 to {MAX_SIDE_LIMIT}, not {max_side!r}")
    quality = DEFAULT_QUALITY if quality is None else quality
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise PackError(f"quality must be a JPEG quality from 1 to 100 (default {DEFAULT_QUALITY}), not {quality!r}")
    return Reencode(max_side, quality)


def orientation_of(image) -> int:
    """The EXIF orientation (1-8) of a lazily opened Pillow image; 1 when absent or invalid."""
    try:
        value = image.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # a damaged EXIF block must not fail the image: it is ignored, as readers ignore it
        return 1
    return value if type(value) is int and 1 <= value <= 8 else 1


def upright_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    return (height, width) if orientation in _SWAPS_SIDES else (width, height)


def target_size(width: int, height: int, max_side: int) -> tuple[int, int] | None:
    """(width, height) scaled so the long side is max_side, or None when it is not over max_side."""
    long_side = max(width, height)
    if long_side <= max_side:
        return None
    scale = max_side / long_side
    if width >= height:
        return max_side, max(1, round(height * scale))
    return max(1, round(width * scale)), max_side


def expected_size(data: bytes, max_side: int, max_pixels: int = MAX_PIXELS) -> tuple[int, int] | None:
    """The upright (width, height) data is stored at when re-encoded under max_side, or None
    when it is stored as it is. Reads the header only."""
    with _opened(data, max_pixels) as image:
        return target_size(*upright_size(*image.size, orientation_of(image)), max_side)


def stored_size(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(width, height) of stored image bytes, from the header."""
    with _opened(data, max_pixels) as image:
        return image.size


def reencode_image(data: bytes, spec: Reencode, max_pixels: int = MAX_PIXELS) -> bytes | None:
    """The re-encoded JPEG bytes of data, or None when data is kept as it is (not over max_side).

    Raises BadImageError, without a path (the caller knows it), when the image cannot be decoded.
    """
    with _opened(data, max_pixels) as image:
        orientation = orientation_of(image)
        size = target_size(*image.size, spec.max_side)  # the long side is the same upright or not
        if size is None:
            return None
        try:
            pixels = _resized(image, size)
        except Exception as exc:  # Pillow raises many types for damaged data
            raise BadImageError(None, f"cannot decode the image to re-encode it ({type(exc).__name__}: {exc})") \
                from exc
    if orientation != 1:
        from PIL import Image

        pixels = pixels.transpose(getattr(Image.Transpose, _UPRIGHT[orientation]))
    return _encode(pixels, spec.quality)


def _opened(data: bytes, max_pixels: int):
    """Pillow's lazy open, refusing an image over max_pixels before any pixel is decoded."""
    try:
        image = open_lazily(data, max_pixels)
    except Exception as exc:
        raise BadImageError(None, f"cannot read the image header ({type(exc).__name__}: {exc})") from exc
    reason = size_problem(*image.size, max_pixels)
    if reason is not None:
        image.close()
        raise BadImageError(None, reason)
    return image


def _resized(image, size: tuple[int, int]):
    """image decoded and resized to size (Lanczos) in L or RGB."""
    from PIL import Image

    image.draft(None, (size[0] * DRAFT_GAP, size[1] * DRAFT_GAP))  # JPEG (and MPO) only; others ignore it
    image.load()
    if image.mode not in ("L", "RGB"):
        image = image.convert("RGB")  # CMYK, palette, alpha, 16-bit: as the readers convert them
    return image.resize(size, Image.Resampling.LANCZOS)


def _encode(image, quality: int) -> bytes:
    import simplejpeg

    pixels = np.asarray(image)
    if image.mode == "L":
        return simplejpeg.encode_jpeg(pixels[:, :, None], quality=quality, colorspace="GRAY")
    return simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=quality, colorspace="RGB",
                                  colorsubsampling="420")


def combined(previous: dict | None, spec: Reencode | None, counts: dict[str, int]) -> dict | None:
    """The "reencode" metadata of a converted dataset: its source's, with this conversion's applied.

    A smaller max_side re-encodes every record the earlier one did (their long side is the
    earlier max_side) and more, so this pass's counts are the totals; a max_side no smaller
    re-encodes nothing, and the earlier record stands.
    """
    if spec is None:
        return previous
    if previous is not None and spec.max_side >= previous["max_side"]:
        return previous
    return spec.record(counts)
