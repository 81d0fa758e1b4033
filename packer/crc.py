"""The CRC-32 every format stores: of each record's image bytes, of each per-record table and
of the metadata. One function computes it, so writers, readers and verify cannot disagree.

It is zlib's CRC-32 (the gzip/PNG polynomial, the value `zlib.crc32` returns), computed
by zlib-ng's SIMD code (carry-less multiply on x86-64, the CRC instructions on ARMv8)
when its wheel is installed, a core dependency, and else by the standard library's zlib:
the same value either way, so every pack stays readable by both, and by any other tool.
A checked warm read is then bound by copying the bytes, not by the check. zlib-ng's
crc32, like zlib's, releases the GIL on large inputs, so threads checksum in parallel.
"""
from __future__ import annotations

import zlib

try:
    from zlib_ng.zlib_ng import crc32 as _crc32
    IMPLEMENTATION = "zlib-ng"
except ImportError:  # the wheel is missing (installed with --no-deps, an exotic platform)
    _crc32 = zlib.crc32
    IMPLEMENTATION = "zlib"


def crc32(data, value: int = 0) -> int:
    """CRC-32 (zlib) of data, any bytes-like object; value: the CRC of the bytes before
    data, to compute one CRC over pieces (crc32(b, crc32(a)) == crc32(a + b))."""
    return _crc32(data, value) & 0xFFFFFFFF
