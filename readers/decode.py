"""Turns stored image bytes into pixels: Pillow images, or uint8 arrays via libjpeg-turbo.

JPEGs in YCbCr or grayscale go through simplejpeg (libjpeg-turbo bundled in its wheel,
the fastest PyPI binding measured here; its output is identical to Pillow's for these).
CMYK/YCCK JPEGs and every other format go through Pillow, so colour conversion matches
torchvision's loader. Output is always RGB. EXIF orientation is not applied, exactly as
torchvision's ImageFolder loader does not apply it.

`min_size` turns on DCT-domain downscaling: libjpeg-turbo decodes at 1/2, 1/4 or 1/8
scale by running a smaller inverse DCT per 8x8 block, which skips most of the IDCT and
colour-conversion work. Only power-of-two scales are used: libjpeg-turbo's other n/8
scales have no SIMD code and measured slower than a full decode (docs/readers.md, "Decode").

Every decode first reads the size from the header and refuses, with CorruptDataError,
an image claiming more than `max_pixels` pixels (default packer.check.MAX_PIXELS, the
limit above which Pillow refuses to open an image), so a few KB of crafted header
cannot make a worker allocate gigabytes. The limit applies to the stored size, also
when a DCT-scaled decode would produce fewer pixels: the entropy decoding still walks
every block.
"""
from __future__ import annotations

import struct

import numpy as np
from PIL import Image

from packer.check import (JPEG_MAGIC, MAX_PIXELS, PNG_MAGIC, TURBO_COLORSPACES, open_lazily, pillow_refusal,
                          size_problem, unusual_precision)
from packer.errors import CorruptDataError

DECODE_MODES = ("pil", "tensor", "numpy", "raw")
DCT_FACTORS = (8, 4, 2)

try:
    import simplejpeg
except ImportError:  # optional at import time so a broken wheel degrades to Pillow
    simplejpeg = None


def decode_pil(data: bytes, where: str | None = None, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """An RGB PIL image, decoded as torchvision's pil_loader decodes it."""
    try:
        with open_pil(data, where, max_pixels) as im:
            return im.convert("RGB")
    except CorruptDataError:
        raise
    except Exception as exc:  # Pillow raises many types for bad data
        raise image_error(where, unusual_precision(data) or f"cannot decode image ({type(exc).__name__}: {exc})") \
            from exc


def open_pil(data: bytes, where: str | None, max_pixels: int) -> Image.Image:
    """Pillow's lazy open (header only), refused before decoding when the image is too large."""
    size = _native_size(data)
    if size is not None:
        check_size(*size, where, max_pixels)
    try:
        im = open_lazily(data, max_pixels)
    except Image.DecompressionBombError as exc:
        raise too_large(where, pillow_refusal(exc, max_pixels)) from exc
    reason = size_problem(im.width, im.height, max_pixels)
    if reason is not None:
        im.close()
        raise too_large(where, reason)
    return im


def _native_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG frame header or PNG IHDR, or None for other formats.

    Read before Pillow opens the image: Pillow refuses a bomb with its own message, which
    gives the pixel count but not the width and height.
    """
    if data.startswith(JPEG_MAGIC) and simplejpeg is not None:
        try:
            return simplejpeg.decode_jpeg_header(data)[:2]
        except ValueError:
            return None
    if data.startswith(PNG_MAGIC) and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack_from(">II", data, 16)
        return height, width
    return None


def image_error(where: str | None, reason: str) -> CorruptDataError:
    """The error for an image that cannot be used, named by where (or "image" when the
    caller only has its bytes), with the bare reason kept for callers that rename it."""
    return CorruptDataError(f"{where or 'image'}: {reason}", where, reason)


def too_large(where: str | None, reason: str) -> CorruptDataError:
    return image_error(where, f"{reason}; if the image is genuine, pass a larger max_pixels= to the dataset "
                              "(or transform)")


def check_size(height: int, width: int, where: str | None, max_pixels: int) -> None:
    """Raise CorruptDataError when a header's size exceeds max_pixels."""
    if height * width > max_pixels:
        raise too_large(where, size_problem(width, height, max_pixels))


def checked_max_pixels(max_pixels) -> int:
    """max_pixels as an int >= 1; there is deliberately no value meaning "no limit"."""
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, (int, np.integer)) or max_pixels < 1:
        raise ValueError(f"max_pixels must be a positive integer (default {MAX_PIXELS}), not {max_pixels!r}")
    return int(max_pixels)


def _turbo_header(data):
    # Any bytes-like object: a GPU batch checks memoryviews of its one buffer.
    if simplejpeg is None or bytes(data[:len(JPEG_MAGIC)]) != JPEG_MAGIC:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in TURBO_COLORSPACES:
        return None
    return height, width


def checked_jpeg_size(data: bytes, where: str | None = None,
                      max_pixels: int = MAX_PIXELS) -> tuple[int, int] | None:
    """(height, width) of a JPEG simplejpeg decodes (not CMYK/YCCK), refused past max_pixels;
    None for anything else. One header parse: what a GPU decoder checks before it allocates."""
    header = _turbo_header(data)
    if header is not None:
        check_size(*header, where, max_pixels)
    return header


def turbo_decodable(data: bytes) -> bool:
    """Whether simplejpeg decodes these bytes (a JPEG that is not CMYK/YCCK)."""
    return _turbo_header(data) is not None


def image_size(data: bytes, where: str | None = None, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(height, width) of the stored image, read from its header without decoding pixels.

    Refuses, as decoding would, an image of more than max_pixels pixels.
    """
    header = checked_jpeg_size(data, where, max_pixels)
    if header is not None:
        return header
    try:
        with open_pil(data, where, max_pixels) as im:
            return im.height, im.width
    except CorruptDataError:
        raise
    except Exception as exc:
        raise image_error(where, unusual_precision(data) or f"cannot read image header ({type(exc).__name__}: {exc})") \
            from exc


def dct_factor(height: int, width: int, min_size: tuple[int, int] | None) -> int:
    """The largest of 8, 4, 2 (else 1) whose scaled size still covers min_size (h, w).

    libjpeg scales a dimension d by 1/k to ceil(d / k).
    """
    if not min_size:
        return 1
    min_h, min_w = min_size
    for k in DCT_FACTORS:
        if -(-height // k) >= min_h and -(-width // k) >= min_w and min(height, width) >= k:
            return k
    return 1


def decode_array(data: bytes, where: str | None = None, min_size: tuple[int, int] | None = None,
                 max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """An HxWx3 uint8 RGB array; libjpeg-turbo for JPEG, Pillow for the rest.

    Args:
        min_size: (height, width) the caller needs at least. A JPEG is then decoded at the
            smallest 1/2, 1/4 or 1/8 scale that is still at least this large in both
            dimensions (full size when none is). Other formats always decode at full size.
    """
    header = _turbo_header(data)
    if header is not None:
        check_size(*header, where, max_pixels)
        k = dct_factor(*header, min_size)
        try:
            if k == 1:
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
            # simplejpeg picks the smallest n/8 scale meeting these; with ceil(d/k) that is 1/k.
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-header[0] // k),
                                          min_width=-(-header[1] // k))
        except ValueError as exc:
            raise image_error(where, unusual_precision(data) or f"cannot decode JPEG ({exc})") from exc
    # np.array, not asarray: Pillow's buffer is read-only and torch warns on such arrays.
    if min_size:
        return np.array(_decode_pil_draft(data, where, min_size, max_pixels))
    return np.array(decode_pil(data, where, max_pixels))


def _decode_pil_draft(data: bytes, where: str, min_size: tuple[int, int], max_pixels: int) -> Image.Image:
    """Pillow's DCT scaling (draft) for the JPEGs simplejpeg leaves to Pillow, e.g. CMYK."""
    try:
        with open_pil(data, where, max_pixels) as im:
            k = dct_factor(im.height, im.width, min_size)
            if k > 1 and im.format == "JPEG":
                # Pillow picks the largest power-of-two scale s with width // s >= requested.
                im.draft(None, (max(1, im.width // k), max(1, im.height // k)))
            return im.convert("RGB")
    except CorruptDataError:
        raise
    except Exception as exc:
        raise image_error(where, unusual_precision(data) or f"cannot decode image ({type(exc).__name__}: {exc})") \
            from exc


def decode_tensor(data: bytes, where: str | None = None, min_size: tuple[int, int] | None = None,
                  max_pixels: int = MAX_PIXELS):
    """A 3xHxW uint8 torch tensor (a view of the decoded HxWx3 array; no copy)."""
    import torch

    array = decode_array(data, where, min_size, max_pixels)
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)


def decode(data: bytes, mode: str, where: str | None = None, max_pixels: int = MAX_PIXELS):
    if mode == "pil":
        return decode_pil(data, where, max_pixels)
    if mode == "tensor":
        return decode_tensor(data, where, max_pixels=max_pixels)
    if mode == "numpy":
        return decode_array(data, where, max_pixels=max_pixels)
    if mode == "raw":
        return data
    raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {mode!r}")
