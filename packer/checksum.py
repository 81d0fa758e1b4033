"""The per-record checksum kinds: what each format stores, in a 4-byte slot, beside each
record's image bytes, and every reader, verify, convert and merge checks. One table here
computes every kind, so none of them can disagree.

  "crc32"  CRC-32 (zlib) of the image bytes (packer.crc): every pack written before kinds
           existed, whose metadata names none, and `--checksum crc32`, for users whose
           other tools check CRC-32 (it is in every language's standard library).
  "xxh3"   the low 32 bits of XXH3-64 (seed 0) of the image bytes, as the `xxhash` wheel
           (a core dependency) computes it: the default. It is the cheapest of the hashes
           measured here (hardware CRC-32C included) on a read's freshly fetched bytes,
           which is what a checked read costs; 32 bits of it detect damage as CRC-32 does
           for all practical purposes (a random change passes with probability 2**-32).

A pack names its kind in its metadata ("checksum", packer.records); the checksums of
tables and of the metadata itself stay CRC-32 (read once per open, not per record).
"""
from __future__ import annotations

from typing import Callable

from xxhash import xxh3_64_intdigest

from . import crc
from .crc import crc32
from .errors import PackError

CRC32 = "crc32"
XXH3 = "xxh3"
DEFAULT = XXH3
LEGACY = CRC32  # the kind of a pack whose metadata names none


def xxh3_32(data) -> int:
    """The low 32 bits of XXH3-64 (seed 0) of data, any bytes-like object."""
    return xxh3_64_intdigest(data) & 0xFFFFFFFF


FUNCTIONS: dict[str, Callable[[bytes], int]] = {CRC32: crc32, XXH3: xxh3_32}
KINDS = tuple(FUNCTIONS)
MASK = 0xFFFFFFFF
# Per kind, a function written in C whose result's low 32 bits (result & MASK) are the
# kind's checksum: a reader calls it on every record, without a Python frame around it.
DIGESTS: dict[str, Callable[[bytes], int]] = {CRC32: crc._crc32, XXH3: xxh3_64_intdigest}


def check_kind(kind, where: str = "") -> str:
    """kind, if it is one this packer computes; else a PackError naming where it came from."""
    if kind not in FUNCTIONS:
        place = f"{where}: " if where else ""
        raise PackError(f"{place}record checksum kind {kind!r} is not one this packer knows ({', '.join(KINDS)}); "
                          "pass one of those, or upgrade packer if a newer one wrote the dataset", where or None)
    return kind


def function(kind: str) -> Callable[[bytes], int]:
    """The function computing kind's 32-bit checksum of a record's image bytes."""
    return FUNCTIONS[check_kind(kind)]


def digest(kind: str) -> Callable[[bytes], int]:
    """kind's DIGESTS function (for hot read paths: compare its result & MASK)."""
    return DIGESTS[check_kind(kind)]


def record_checksum(data, kind: str = DEFAULT) -> int:
    """kind's checksum of a record's image bytes (an int below 2**32)."""
    return function(kind)(data)
