"""Opt-in re-encoding: the images `pack`/`convert` `--max-side` shrink and `--baseline-420` re-forms.

Decoding is what bounds training throughput once records are packed, and its cost grows
with the pixels stored: storing images at a bounded long side is how FFCV speeds up
ImageNet training (docs/resolution.md has the measured gain and the accuracy trade-off).

The rule is a pure function of the source image, so verify can re-derive it: an image is
re-encoded if and only if its upright long side (after its EXIF orientation) is over
max_side, or, with baseline_420, it is not already a baseline 4:2:0 (or grayscale) 8-bit
JPEG (packer.jpeg_form: the form cheapest to decode, which GPU JPEG engines take). Every
other image is stored byte for byte, exactly as without the options. A re-encoded image is:
  - decoded (JPEG through libjpeg's DCT scaling down to at least twice the target size,
    as Pillow's thumbnail() does, so the final filter still sees the detail), CMYK and
    palette/alpha images converted to RGB as the readers convert them, grayscale kept
    grayscale;
  - resized with Lanczos so its long side is max_side and its aspect ratio kept (short
    side rounded, at least 1 pixel: target_size), if it is over max_side; one re-encoded
    only for its form keeps its size;
  - turned upright by its EXIF orientation (after resizing: a lossless transpose of fewer
    pixels), so the stored pixels are upright and carry no orientation tag;
  - encoded as baseline JPEG at `quality` with 4:2:0 chroma subsampling (libjpeg-turbo,
    through simplejpeg), whatever the source format (a PNG over the limit becomes a JPEG;
    the record keeps its source path, which is its identity), carrying the digest of its
    source's bytes in a comment (packer.source_digest) for verify --against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .check import MAX_PIXELS, jpeg_problem, open_lazily, size_problem, sniff, strict_jpeg_problem
from .errors import BadImageError, PackError
from .jpeg_form import BASELINE_420, in_baseline_420
from .source_digest import stamped

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
    """What to re-encode (images whose upright long side is over max_side and, with
    baseline_420, images not in that form) and how (JPEG quality). A max_side of
    MAX_SIDE_LIMIT, which no image is over, bounds nothing."""

    max_side: int = MAX_SIDE_LIMIT
    quality: int = DEFAULT_QUALITY
    baseline_420: bool = False

    def record(self, counts: dict[str, int]) -> dict:
        """The metadata's "reencode" object (packer.records checks it when read)."""
        found = {"max_side": self.max_side, "quality": self.quality, "counts": dict(counts)}
        if self.baseline_420:
            found["form"] = BASELINE_420
        return found

    @classmethod
    def from_record(cls, record: dict) -> "Reencode":
        return cls(record["max_side"], record["quality"], record.get("form") == BASELINE_420)

    def keeps(self, data: bytes, upright: tuple[int, int]) -> bool:
        """Whether an image of this upright size is stored as it is (data: its bytes)."""
        return max(upright) <= self.max_side and (not self.baseline_420 or in_baseline_420(data))


def reencode_spec(max_side: int | None, quality: int | None, baseline_420: bool = False) -> Reencode | None:
    """The checked Reencode for pack()/convert() arguments, or None when neither max_side
    nor baseline_420 asks for one."""
    if max_side is None and not baseline_420:
        if quality is not None:
            raise PackError("quality applies to re-encoded images: pass max_side or baseline_420 too")
        return None
    if not isinstance(baseline_420, bool):
        raise PackError(f"baseline_420 must be True or False, not {baseline_420!r}")
    max_side = MAX_SIDE_LIMIT if max_side is None else max_side
    if isinstance(max_side, bool) or not isinstance(max_side, int) or not 1 <= max_side <= MAX_SIDE_LIMIT:
        raise PackError(f"max_side must be a whole number of pixels from 1 to {MAX_SIDE_LIMIT}, not {max_side!r}")
    quality = DEFAULT_QUALITY if quality is None else quality
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise PackError(f"quality must be a JPEG quality from 1 to 100 (default {DEFAULT_QUALITY}), not {quality!r}")
    return Reencode(max_side, quality, baseline_420)


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


def expected_size(data: bytes, spec: Reencode, max_pixels: int = MAX_PIXELS) -> tuple[int, int] | None:
    """The upright (width, height) data is stored at when re-encoded under spec, or None
    when it is stored as it is. Reads the headers only."""
    with _opened(data, max_pixels) as image:
        upright = upright_size(*image.size, orientation_of(image))
    if spec.keeps(data, upright):
        return None
    return target_size(*upright, spec.max_side) or upright


def stored_size(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(width, height) of stored image bytes, from the header."""
    with _opened(data, max_pixels) as image:
        return image.size


def reencode_image(data: bytes, spec: Reencode, max_pixels: int = MAX_PIXELS) -> bytes | None:
    """The re-encoded JPEG bytes of data, or None when data is kept as it is (Reencode.keeps).

    Raises BadImageError, without a path (the caller knows it), when the image cannot be decoded.
    """
    with _opened(data, max_pixels) as image:
        orientation = orientation_of(image)
        if spec.keeps(data, image.size):  # the long side is the same upright or not
            return None
        size = target_size(*image.size, spec.max_side) or image.size
        refuse_damaged(data, max_pixels)
        try:
            pixels = _resized(image, size)
        except Exception as exc:  # Pillow raises many types for damaged data
            raise BadImageError(None, f"cannot decode the image to re-encode it ({type(exc).__name__}: {exc})") \
                from exc
    if orientation != 1:
        from PIL import Image

        pixels = pixels.transpose(getattr(Image.Transpose, _UPRIGHT[orientation]))
    return stamped(_encode(pixels, spec.quality), data)


def refuse_damaged(data: bytes, max_pixels: int) -> None:
    """BadImageError when a strict decode rejects the JPEG about to be re-encoded: Pillow's
    decode greys over a cut or corrupt scan, and the re-encoded copy would be a valid JPEG
    that no later check could tell from the photo (a source kept as it is stays as
    damaged as it came, for --check full and the readers to find)."""
    if sniff(data) != "jpeg":
        return
    reason = jpeg_problem(data, max_pixels) or strict_jpeg_problem(data, max_pixels, scaled=True)
    if reason is not None:
        raise BadImageError(None, f"{reason}; not re-encoded, which would hide the damage")


def _opened(data: bytes, max_pixels: int):
    """Pillow's lazy open, refusing an image over max_pixels before any pixel is decoded."""
    try:
        image = open_lazily(data, max_pixels)
    except Exception as exc:
        known = jpeg_problem(data, max_pixels) if sniff(data) == "jpeg" else None  # a 12-bit JPEG, say
        raise BadImageError(None, known or f"cannot read the image header ({type(exc).__name__}: {exc})") from exc
    reason = size_problem(*image.size, max_pixels)
    if reason is not None:
        image.close()
        raise BadImageError(None, reason)
    return image


def _resized(image, size: tuple[int, int]):
    """image decoded and resized to size (Lanczos) in L or RGB."""
    from PIL import Image

    if size != image.size:
        image.draft(None, (size[0] * DRAFT_GAP, size[1] * DRAFT_GAP))  # JPEG (and MPO) only; others ignore it
    image.load()
    if image.mode not in ("L", "RGB"):
        image = image.convert("RGB")  # CMYK, palette, alpha, 16-bit: as the readers convert them
    if image.size == size:  # re-encoded for its form alone: a copy, which outlives the closed file
        return image.copy()
    return image.resize(size, Image.Resampling.LANCZOS)


def _encode(image, quality: int) -> bytes:
    import simplejpeg

    pixels = np.asarray(image)
    if image.mode == "L":
        return simplejpeg.encode_jpeg(pixels[:, :, None], quality=quality, colorspace="GRAY")
    return simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=quality, colorspace="RGB",
                                  colorsubsampling="420")


def combinable(previous: dict | None, spec: Reencode | None, where: str) -> None:
    """Refuse a conversion whose re-encoded records could not be counted (combined()).

    A dataset packed with baseline_420 does not record which of its records were
    re-encoded for their form: a smaller max_side re-encodes some of them again and some
    records kept as they were, and the union is unknown.
    """
    if spec is None or previous is None or previous.get("form") != BASELINE_420:
        return
    if spec.max_side < previous["max_side"]:
        raise PackError(f"{where} was packed with --baseline-420, which does not record which records it re-encoded, "
                        f"so a smaller --max-side ({spec.max_side}) cannot count the records re-encoded in all: pack "
                        f"the source folder with --max-side {spec.max_side} --baseline-420 instead", where)


def combined(previous: dict | None, spec: Reencode | None, counts: dict[str, int]) -> dict | None:
    """The "reencode" metadata of a converted dataset: its source's, with this conversion's applied.

    A smaller max_side re-encodes every record the earlier one did (their long side is the
    earlier max_side) and more, so this pass's counts are the totals. A max_side no smaller
    re-encodes only records not in the form baseline_420 asks for: none if the earlier
    pass asked for it too (the earlier record stands), else none the earlier pass
    re-encoded (packer's JPEGs are in that form), so the counts add up. combinable()
    refuses the one case left, a smaller max_side after baseline_420.
    """
    if spec is None:
        return previous
    if previous is None:
        return spec.record(counts)
    before = Reencode.from_record(previous)
    if spec.max_side < before.max_side:
        return spec.record(counts)
    if before.baseline_420 or not spec.baseline_420:
        return previous
    total = {name: previous["counts"].get(name, 0) + counts.get(name, 0) for name in {*previous["counts"], *counts}}
    return Reencode(before.max_side, spec.quality, True).record(total)
