"""What every format stores: the checksum, the path table and the JSON metadata schema.

Writers and readers of all formats share these definitions, so a dataset's metadata
means the same thing whichever container holds it. Nothing here is ever pickled: the
metadata is UTF-8 JSON, paths are NUL-separated UTF-8, arrays are little-endian.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from .errors import FormatError

# Bumped when a layout changes incompatibly; readers refuse newer versions by name.
FORMAT_VERSION = 1
UNLABELED = -1
# Filenames that are not valid UTF-8 (possible on Linux) survive as surrogate escapes.
PATH_ENCODING_ERRORS = "surrogateescape"


def checksum(data: bytes) -> int:
    """CRC-32 (zlib polynomial) of the image bytes: fast, and in every language's stdlib."""
    return zlib.crc32(data) & 0xFFFFFFFF


def encode_path(relpath: str) -> bytes:
    return relpath.encode("utf-8", PATH_ENCODING_ERRORS)


def decode_path(raw: bytes) -> str:
    return raw.decode("utf-8", PATH_ENCODING_ERRORS)


class PathTable:
    """An immutable list of strings held as one byte blob plus offsets.

    A list of a million Python strings is touched by refcounting on every access, so a
    forked DataLoader worker ends up copying it; one bytes object and a numpy array stay
    shared. Each path in the blob is followed by a NUL, a byte no filename can contain.
    """

    __slots__ = ("data", "offsets")

    def __init__(self, data: bytes, offsets: np.ndarray):
        # One bytes object: slicing it is the cheapest per-read lookup, and refcounting
        # writes only its header page, so forked workers keep sharing the rest.
        self.data = data
        self.offsets = offsets

    @classmethod
    def from_strings(cls, strings: Iterable[str]) -> "PathTable":
        return cls.from_nul_separated(b"\0".join(encode_path(s) for s in strings))

    @classmethod
    def from_nul_separated(cls, raw: bytes) -> "PathTable":
        """Parse the on-disk form: UTF-8 paths joined by NUL."""
        data = raw + b"\0"
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 0) + 1
        if not raw:
            ends = ends[:0]  # an empty table, not one empty path
        return cls(data, np.concatenate(([0], ends)).astype(np.int64))

    def to_nul_separated(self) -> bytes:
        return self.data[:-1]

    def raw(self, i: int) -> bytes:
        return self.data[self.offsets.item(i):self.offsets.item(i + 1) - 1]

    def __getitem__(self, i: int) -> str:
        n = len(self.offsets) - 1
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"path index {i} out of range for {n} paths")
        return decode_path(self.raw(i))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@dataclass
class SplitInfo:
    count: int
    bytes: int
    class_counts: list[int]
    labeled: bool = True


@dataclass
class Metadata:
    """The dataset-level facts every format stores under its documented metadata key."""

    format: str  # "lmdb", "hdf5", "wds": the container
    classes: list[str]
    splits: dict[str, SplitInfo]
    source: str = ""
    created: str = ""
    packer_version: str = ""
    params: dict = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    @property
    def count(self) -> int:
        return sum(s.count for s in self.splits.values())

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.splits.values())

    def to_dict(self) -> dict:
        return {
            "format": self.format,
            "format_version": self.format_version,
            "count": self.count,
            "bytes": self.bytes,
            "classes": list(self.classes),
            "splits": {
                name: {"count": s.count, "bytes": s.bytes, "labeled": s.labeled,
                       "class_counts": list(s.class_counts)}
                for name, s in self.splits.items()
            },
            "skipped": list(self.skipped),
            "source": self.source,
            "created": self.created,
            "packer_version": self.packer_version,
            "params": dict(self.params),
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1).encode("utf-8", PATH_ENCODING_ERRORS)

    @classmethod
    def from_json(cls, raw: bytes | str, where: str) -> "Metadata":
        try:
            d = json.loads(raw.decode("utf-8", PATH_ENCODING_ERRORS) if isinstance(raw, bytes) else raw)
            version = int(d["format_version"])
            if version > FORMAT_VERSION:
                raise FormatError(
                    f"{where}: written with format version {version}, this packer reads up to "
                    f"{FORMAT_VERSION} (upgrade packer to read it)", where)
            splits = {name: SplitInfo(int(s["count"]), int(s["bytes"]),
                                      [int(c) for c in s["class_counts"]], bool(s.get("labeled", True)))
                      for name, s in d["splits"].items()}
            return cls(format=d["format"], classes=list(d["classes"]), splits=splits,
                       source=d.get("source", ""), created=d.get("created", ""),
                       packer_version=d.get("packer_version", ""), params=d.get("params", {}),
                       skipped=d.get("skipped", []), format_version=version)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{where}: unreadable packer metadata ({exc}); the dataset is damaged, "
                              "re-pack it from its source", where) from exc


def choose_split(splits: Sequence[str], split: str | None, where: str) -> str:
    """Resolve a reader's split= argument against the splits a dataset holds."""
    if split is None:
        if len(splits) == 1:
            return splits[0]
        raise FormatError(f"{where} holds splits {', '.join(splits)}: pass split= one of them", where)
    if split not in splits:
        raise FormatError(f"{where} has no split {split!r}; it holds: {', '.join(splits)}", where)
    return split

