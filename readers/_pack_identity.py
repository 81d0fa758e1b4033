"""A pack's own identity, as a resume state names the data it was saved over.

A state's fingerprint names a dataset without its path (it may move between machines),
by its shape: sample count, split, classes. A dataset re-packed at the same path from
other images of the same count and classes has that shape too, and a state saved over
the first would resume its order over the second's images. So a packer dataset's
fingerprint also names the pack: when it was made (its metadata's "created") and a
CRC-32 of what the pack stores about its contents: the split's counts and bytes and its
tables' checksums (LMDB, HDF5: the record checksum table's among them; WDS: every
shard's SHA-256 in index.json). A state without it was saved before fingerprints named
the pack, and is refused with what to do (readers.sampler.check_state).
"""
from __future__ import annotations

import json
import zlib

SEPARATOR = ", packed "  # what follows a fingerprint's shape: the pack's identity


def pack_identity(created: str, contents) -> str:
    """", packed <created> (contents crc32 <hex>)": appended to a packer dataset's fingerprint."""
    text = json.dumps(contents, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    crc = zlib.crc32(text.encode("utf-8", "surrogateescape"))
    return f"{SEPARATOR}{created or 'at an unknown time'} (contents crc32 {crc:08x})"


def reader_identity(reader) -> str:
    """The identity of the pack a packer Reader reads (one split of it)."""
    split = reader.metadata.splits[reader.split]
    return pack_identity(reader.metadata.created, {"count": split.count, "bytes": split.bytes,
                                                   "class_counts": list(split.class_counts),
                                                   "tables": reader.table_checksums()})


def index_identity(indexed) -> str:
    """The identity of a `packer pack --to wds` folder's split (packer.formats.wds_shards.IndexedSplit),
    from its index.json (every shard's name, count, bytes and SHA-256, and the tables' checksums)."""
    return pack_identity(indexed.created, indexed.contents)


def without_identity(saved, now: str) -> bool:
    """Whether `saved` is `now` as a state saved before fingerprints named the pack gives it."""
    return isinstance(saved, str) and SEPARATOR in now and now.startswith(saved + SEPARATOR)
