"""The CRC-32 every format stores: of each record's image bytes, of each per-record table and
of the metadata. One function computes it, so writers, readers and verify cannot disagree.

It is zlib's CRC-32 (the gzip/PNG polynomial, the value `zlib.crc32` returns), computed
by libdeflate's SIMD code (carry-less multiplication on x86-64, PMULL and the CRC
instructions on ARMv8) through the `deflate` wheel, a core dependency, and else by the
standard library's zlib: the same value either way, so every pack stays readable by
both, and by any other tool. Chosen by measurement over zlib-ng's and ISA-L's SIMD
CRC-32s: of the three, it adds the least to a checked read. It holds the GIL (zlib's
releases it on large inputs), which costs threads little: a few microseconds per image.
"""
from __future__ import annotations

import zlib

try:
    from deflate import crc32 as _crc32
    IMPLEMENTATION = "libdeflate"
except ImportError:  # the wheel is missing (installed with --no-deps, an exotic platform)
    _crc32 = zlib.crc32
    IMPLEMENTATION = "zlib"


def crc32(data, value: int = 0) -> int:
    """CRC-32 (zlib) of data, any bytes-like object; value: the CRC of the bytes before
    data, to compute one CRC over pieces (crc32(b, crc32(a)) == crc32(a + b))."""
    return _crc32(data, value) & 0xFFFFFFFF
