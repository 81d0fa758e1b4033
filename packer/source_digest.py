"""The digest of its source file that a re-encoded record carries, for `verify --against`.

A re-encoded record cannot be compared with its source byte for byte, and its size alone
would pass another photo of the same size. So a re-encoded JPEG starts, right after its
SOI marker, with a comment segment (COM, FF FE) holding the ASCII text
`packer-source blake2b-128 <32 hex digits>`: the BLAKE2b digest (16 bytes) of the source
file's bytes. Decoders skip comments, and the record's checksum covers it like any byte.
A record re-encoded again (convert with a smaller --max-side) keeps the digest it carries,
so the digest always names the file in SRC. Records re-encoded by earlier versions carry
none: verify compares those by size alone, and says so.
"""
from __future__ import annotations

import hashlib
import re

PREFIX = b"packer-source blake2b-128 "
_COMMENT = re.compile(rb"\xff\xd8\xff\xfe(..)" + re.escape(PREFIX) + rb"([0-9a-f]{32})", re.DOTALL)


def digest(data) -> str:
    """The hex BLAKE2b-128 digest of a source file's bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def carried(record) -> str | None:
    """The source digest a record carries in its first segment, or None (kept as it was, or
    re-encoded before records carried one). The comment's length must be exactly its text."""
    found = _COMMENT.match(bytes(record[:4 + 2 + len(PREFIX) + 32]))
    if found is None or int.from_bytes(found.group(1), "big") != 2 + len(PREFIX) + 32:
        return None
    return found.group(2).decode("ascii")


def stamped(encoded: bytes, source) -> bytes:
    """encoded (a JPEG re-encoded from source) with the comment naming source's digest (the
    one source carries where it is itself a re-encoded record)."""
    body = PREFIX + (carried(source) or digest(source)).encode("ascii")
    return encoded[:2] + b"\xff\xfe" + (len(body) + 2).to_bytes(2, "big") + body + encoded[2:]
