"""Turns stored image bytes into pixels: Pillow images, or uint8 arrays via libjpeg-turbo.

JPEGs in YCbCr or grayscale go through simplejpeg (libjpeg-turbo bundled in its wheel,
the fastest PyPI binding measured here; its output is identical to Pillow's for these).
CMYK/YCCK JPEGs and every other format go through Pillow, so colour conversion matches
torchvision's loader. Output is always RGB. EXIF orientation is not applied, exactly as
torchvision's ImageFolder loader does not apply it.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from packer.errors import CorruptDataError

DECODE_MODES = ("pil", "tensor", "numpy", "raw")
JPEG_MAGIC = b"\xff\xd8\xff"

try:
    import simplejpeg
except ImportError:  # optional at import time so a broken wheel degrades to Pillow
    simplejpeg = None


def decode_pil(data: bytes, where: str = "image") -> Image.Image:
    """An RGB PIL image, decoded as torchvision's pil_loader decodes it."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")
    except Exception as exc:  # Pillow raises many types for bad data
        raise CorruptDataError(f"{where}: cannot decode image ({type(exc).__name__}: {exc})", where) from exc


def turbo_decodable(data: bytes) -> bool:
    if simplejpeg is None or not data.startswith(JPEG_MAGIC):
        return False
    try:
        _, _, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return False
    return colorspace in ("YCbCr", "Gray", "RGB")


def decode_array(data: bytes, where: str = "image") -> np.ndarray:
    """An HxWx3 uint8 RGB array; libjpeg-turbo for JPEG, Pillow for the rest."""
    if turbo_decodable(data):
        try:
            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        except ValueError as exc:
            raise CorruptDataError(f"{where}: cannot decode JPEG ({exc})", where) from exc
    return np.asarray(decode_pil(data, where))


def decode_tensor(data: bytes, where: str = "image"):
    """A 3xHxW uint8 torch tensor."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(decode_array(data, where))).permute(2, 0, 1)


def decode(data: bytes, mode: str, where: str = "image"):
    if mode == "pil":
        return decode_pil(data, where)
    if mode == "tensor":
        return decode_tensor(data, where)
    if mode == "numpy":
        return decode_array(data, where)
    if mode == "raw":
        return data
    raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {mode!r}")
