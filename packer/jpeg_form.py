"""What an image's headers say about how it decodes: its JPEG coding process, precision,
colour space and chroma subsampling, read without decoding a pixel (packer.check's
marker walk), and the two forms packer names from them.

  - baseline 4:2:0, the form `--baseline-420` stores (packer.reencode): a baseline
    (SOF0: sequential, Huffman, 8-bit) JPEG, either YCbCr with both chroma planes at half
    the width and height (4:2:0) or grayscale. It is the cheapest common form to decode on
    a CPU (libjpeg-turbo decodes a quarter of the chroma samples of 4:4:4, in one pass,
    where a progressive file is decoded in several) and the form FFCV stores.
  - hardware: what the JPEG engines of an A100/H100 decode (nvJPEG's hardware backend),
    per NVIDIA's nvJPEG guide ("hardware acceleration for baseline JPEG decode") and
    nvImageCodec's hardware decoder (extensions/nvjpeg/hw_decoder.cpp), which accepts the
    subsamplings 4:4:4, 4:2:2, 4:2:0, 4:4:0 and grayscale: a baseline JPEG of 1 (gray) or
    3 (YCbCr) components in one of those. Anything else (progressive, CMYK/YCCK, 4:1:1,
    12-bit, PNG...) falls back to the CUDA or CPU decoder.

A 3-component JPEG is YCbCr unless an Adobe APP14 segment says transform 0, or it has no
JFIF or Adobe segment and its component ids are 'R', 'G', 'B' (libjpeg's rules); a
4-component one is YCCK with Adobe transform 2, CMYK otherwise.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .check import SOF_MARKERS, jpeg_segments, sniff

BASELINE_420 = "baseline-420"  # the form's name in the metadata and on the command line
BASELINE = 0xC0  # SOF0
PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
APP0, APP14 = 0xE0, 0xEE
# Chroma subsampling by (horizontal, vertical) ratio of the luma sampling to the chroma's.
_SUBSAMPLING = {(1, 1): "4:4:4", (2, 1): "4:2:2", (2, 2): "4:2:0", (1, 2): "4:4:0", (4, 1): "4:1:1",
                (4, 2): "4:1:0"}
HARDWARE_SUBSAMPLINGS = frozenset({"4:4:4", "4:2:2", "4:2:0", "4:4:0", "gray"})


@dataclass(frozen=True)
class JpegForm:
    """A JPEG's coding form, from its headers."""

    sof: int  # the start-of-frame marker: 0xC0 baseline, 0xC1 extended, 0xC2 progressive...
    precision: int  # bits per sample
    colorspace: str  # "YCbCr", "Gray", "RGB", "CMYK", "YCCK"
    subsampling: str  # "4:2:0", "4:4:4", ..., "gray", or "other"

    @property
    def baseline(self) -> bool:
        return self.sof == BASELINE and self.precision == 8

    @property
    def progressive(self) -> bool:
        return self.sof in PROGRESSIVE

    @property
    def baseline_420(self) -> bool:
        """In the form --baseline-420 stores: baseline, and YCbCr 4:2:0 or grayscale."""
        return self.baseline and (self.colorspace == "Gray" or
                                  (self.colorspace == "YCbCr" and self.subsampling == "4:2:0"))

    @property
    def hardware(self) -> bool:
        """Decodable by nvJPEG's hardware engines (module docstring)."""
        return self.baseline and self.colorspace in ("YCbCr", "Gray") and self.subsampling in HARDWARE_SUBSAMPLINGS


def jpeg_form(data: bytes) -> JpegForm | None:
    """The form of a JPEG from its headers, or None for data that is no JPEG or whose
    headers end or break before the frame header (the header check reports those)."""
    if sniff(data) != "jpeg":
        return None
    jfif, adobe_transform = False, None
    try:
        for marker, start, end in jpeg_segments(data):
            payload = data[start:end]
            if marker == APP0 and payload.startswith(b"JFIF\0"):
                jfif = True
            elif marker == APP14 and payload.startswith(b"Adobe") and len(payload) >= 12:
                adobe_transform = payload[11]
            elif marker in SOF_MARKERS:
                return _frame_form(marker, payload, jfif, adobe_transform)
    except ValueError:
        return None
    return None


def _frame_form(sof: int, payload: bytes, jfif: bool, adobe_transform: int | None) -> JpegForm | None:
    if len(payload) < 6:
        return None
    precision, count = payload[0], payload[5]
    components = [struct.unpack_from(">BBB", payload, 6 + 3 * i) for i in range(count)
                  if 6 + 3 * i + 3 <= len(payload)]
    if count == 0 or len(components) != count:
        return None
    if count == 1:
        return JpegForm(sof, precision, "Gray", "gray")
    colorspace = _colorspace(components, jfif, adobe_transform)
    return JpegForm(sof, precision, colorspace, _subsampling(components) if count == 3 else "other")


def _colorspace(components: list[tuple[int, int, int]], jfif: bool, adobe_transform: int | None) -> str:
    if len(components) == 4:
        return "YCCK" if adobe_transform == 2 else "CMYK"
    if len(components) != 3:
        return "other"
    if adobe_transform is not None:
        return "RGB" if adobe_transform == 0 else "YCbCr"
    if not jfif and [c[0] for c in components] == [ord("R"), ord("G"), ord("B")]:
        return "RGB"
    return "YCbCr"


def _subsampling(components: list[tuple[int, int, int]]) -> str:
    """4:2:0 and the like, from the sampling factors of Y, Cb and Cr (each byte: h << 4 | v)."""
    (h_y, v_y), chroma = _factors(components[0]), {_factors(c) for c in components[1:]}
    if len(chroma) != 1:
        return "other"
    h_c, v_c = chroma.pop()
    if h_c == 0 or v_c == 0 or h_y % h_c or v_y % v_c:
        return "other"
    return _SUBSAMPLING.get((h_y // h_c, v_y // v_c), "other")


def _factors(component: tuple[int, int, int]) -> tuple[int, int]:
    return component[1] >> 4, component[1] & 0x0F


def in_baseline_420(data: bytes) -> bool:
    """Whether data is an image in the form --baseline-420 stores."""
    form = jpeg_form(data)
    return form is not None and form.baseline_420


def form_summary(counts: dict) -> str:
    """One line of a census (packer.verify.census): the shares the hardware decoder and the
    baseline 4:2:0 form take, and the subsamplings seen."""
    n = counts["sampled"]
    if n == 0:
        return "no records"

    def share(k: int) -> str:
        return f"{100 * k / n:.0f}%"

    seen = ", ".join(f"{name} {share(k)}" for name, k in sorted(counts["subsampling"].items(), key=lambda kv: -kv[1]))
    return (f"{share(counts['hardware'])} decodable by GPU JPEG engines (baseline 8-bit YCbCr 4:4:4/4:2:2/4:2:0/"
            f"4:4:0 or gray), {share(counts['baseline_420'])} baseline 4:2:0 or gray, "
            f"{share(counts['progressive'])} progressive, {share(n - counts['jpeg'] - counts['unreadable'])} not JPEG; "
            f"{seen or 'no JPEG'} (of {n} records sampled evenly"
            + (f"; {counts['unreadable']} unreadable: run packer verify)" if counts["unreadable"] else ")"))
