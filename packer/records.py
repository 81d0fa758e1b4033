"""What every format stores: the checksum, the path table and the JSON metadata schema.

Writers and readers of all formats share these definitions, so a dataset's metadata
means the same thing whichever container holds it. Nothing here is ever pickled: the
metadata is UTF-8 JSON, paths are NUL-separated UTF-8, arrays are little-endian.

Everything read from a dataset is untrusted, and checked here once, as it is loaded:
  - the path table: every path is relative, with no empty, "." or ".." component, so
    joining it to a folder (verify --against) or making it a tar member name (wds) never
    leaves that folder;
  - the metadata: every field's type and range (Metadata.from_json), split names that are
    one plain folder name (check_split_name), and its checksum.

The metadata checksum, "crc32", lets any tool detect a damaged class list or count. It
is the CRC-32 (zlib) of
    json.dumps(rest, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
encoded as UTF-8 with surrogateescape, where rest is the metadata JSON object without
its "crc32" key and without the keys its container owns: in a WDS index.json, which is
the metadata object plus "wds" (the shard list), that is "wds"; shards have their own
SHA-256s and sizes there. Metadata without "crc32" (written before it existed) is
accepted, provided it holds only the keys those versions wrote.

The optional "parts" object (absent from a dataset packed in one piece) says that a
dataset is one part of a source packed in pieces, or was merged from such parts
(docs/parts.md has the whole story). A part of N, index I counted from 0, holds the
records [I*T//N, (I+1)*T//N) of the T files its source lists, all splits in sorted name
order, one after the other (part_bounds, split_bounds):
  {"fingerprint": "sha256:<hex>", "count": N, "index": I, "host": "<packing host>",
   "total": T, "start": <first>, "stop": <end>,
   "splits": {"<split>": {"listed": <files the source lists>, "start": <first>, "stop": <end>,
                          "skipped_at": [<positions in [0, stop - start) of the files left out>]}}}
The fingerprint is the source's (packer.cut.source_fingerprint); every split of the
source is listed, an empty range included. A merged dataset has instead
  {"fingerprint": ..., "count": N, "total": T,
   "merged": [{"index": I, "path": ..., "host": ..., "created": ..., "count": <records>}, ...]}
one entry per part, in index order.
"reencode", present only in a dataset packed or converted with --max-side or
--baseline-420 (packer.reencode), is {"max_side": N, "quality": Q, "counts": {split:
records re-encoded}}: the records whose upright long side was over N are stored as JPEGs
at quality Q, the others byte for byte. With --baseline-420 the metadata also holds
"reencode_form": "baseline-420": the records not already baseline 4:2:0 (or grayscale)
JPEGs were re-encoded too, and N is 65535 when no --max-side bounded them. The form is a
key of its own, beside "reencode" rather than in it, because packers that predate it
accept a "reencode" with exactly those three keys: they read such a dataset, and only
their `verify --against` reports the records re-encoded for their form as differing.
Metadata.reencode holds it as "form". Their absence (every pack before they existed, and
every pack without either option) means no record was re-encoded. They change no byte
layout, so format_version stays (the keys are covered by "crc32").
"checksum" names the kind of every record's checksum (packer.checksum: "crc32" or
"xxh3"); absent, in every pack written before kinds existed and every pack written with
"crc32" (whose metadata is then what any packer wrote), it is "crc32". A dataset
whose kind is not "crc32" is written with format_version 2, so a packer that predates
kinds refuses it by version rather than reading every record as damaged; one with
"crc32" keeps format_version 1, readable by any packer.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from . import checksum as record_checksums
from ._metadata_fields import (MAX_BYTES, MAX_RECORDS, _checksum_kind, _classes, _count, _Invalid, _params, _parts,
                               _reencode, _show, _skipped, _text)
from ._metadata_fields import MAX_PARTS, part_bounds, split_bounds  # noqa: F401 (packer.cut imports them from here)
from .crc import crc32
from .errors import CorruptDataError, FormatError, redacted

# Bumped when a layout changes incompatibly; readers refuse newer versions by name.
# 2: the record checksum may be of another kind than CRC-32 ("checksum").
FORMAT_VERSION = 2
UNLABELED = -1
# Filenames that are not valid UTF-8 (possible on Linux) survive as surrogate escapes.
PATH_ENCODING_ERRORS = "surrogateescape"
# The form of a format's name in metadata (a key of packer.formats.FORMATS: records sits below the
# formats, so packer.formats.read_metadata and every Reader check that the name is one of them).
FORMAT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
# Read limits on metadata: far above any real dataset's, low enough that parsing a hostile
# one cannot exhaust memory or, for nesting, the stack of whoever serialises it next.
MAX_METADATA_BYTES = 64 << 20
MAX_WRITTEN_METADATA_BYTES = MAX_METADATA_BYTES // 2  # leaves room for the indented form
MAX_NESTING = 100
MAX_NAME_BYTES = 255  # a file name's limit on common file systems
# The keys metadata without a "crc32" may hold: all that packer wrote before it had one.
UNCHECKED_KEYS = frozenset({"format", "format_version", "count", "bytes", "classes", "splits", "skipped",
                            "source", "created", "packer_version", "params"})
# In a path table with each "/" turned into NUL: an empty, "." or ".." component or path.
_UNSAFE_COMPONENT = re.compile(rb"\x00\.{0,2}\x00")
_SLASH_TO_NUL = bytes.maketrans(b"/", b"\x00")


def checksum(data: bytes) -> int:
    """CRC-32 (zlib polynomial) of data: the metadata's checksum, and the "crc32" record
    checksum kind (packer.checksum computes every kind); in every language's stdlib, and
    computed here at memory speed (packer.crc)."""
    return crc32(data)


def encode_path(relpath: str) -> bytes:
    return relpath.encode("utf-8", PATH_ENCODING_ERRORS)


def decode_path(raw: bytes) -> str:
    return raw.decode("utf-8", PATH_ENCODING_ERRORS)


class PathSequence:
    """Paths by index from a subclass's len() and raw(i) (path i's bytes): indexing (negative
    from the end, out of range an IndexError) and iteration, shared by the table held in
    memory (PathTable) and the one read through stored offsets (formats._index_tables)."""

    __slots__ = ()

    def raw(self, i: int) -> bytes:
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"path index {i} out of range for {n} paths")
        return decode_path(self.raw(i))

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class PathTable(PathSequence):
    """An immutable list of strings held as one byte blob plus offsets.

    A list of a million Python strings is touched by refcounting on every access, so a
    forked DataLoader worker ends up copying it; one buffer and a numpy array stay
    shared. The blob is the on-disk form (paths joined by NUL, a byte no filename can
    contain): a bytes object, or a read-only map of the table's bytes in the dataset file
    (packer.formats._tables.map_region), whose pages are the page cache's, shared by every
    process that reads the dataset instead of copied into each.
    """

    __slots__ = ("data", "offsets")
    # Paths checked per pass of check_relative: bounds its temporary copies to a few MB.
    CHECK_BLOCK = 1 << 12

    def __init__(self, data, offsets: np.ndarray):
        # data: bytes or mmap, both sliced straight to bytes (the cheapest per-read lookup);
        # refcounting writes only the object's header, so forked workers keep sharing the rest.
        # Path i is data[offsets[i]:offsets[i + 1] - 1] (each path but the last is followed by a NUL).
        self.data = data
        self.offsets = offsets

    @classmethod
    def from_strings(cls, strings: Iterable[str]) -> "PathTable":
        return cls.from_nul_separated(b"\0".join(encode_path(s) for s in strings))

    @classmethod
    def from_nul_separated(cls, raw, where: str = "path table", start: int = 0,
                           length: int | None = None) -> "PathTable":
        """Parse the on-disk form: UTF-8 paths joined by NUL, raw[start:start + length]
        (raw: bytes, or a map of the dataset file's bytes, used in place, not copied).

        Raises CorruptDataError naming `where` if a path is not a safe relative path."""
        size = len(raw) - start if length is None else length
        table = cls(raw, path_offsets(raw, start, size))
        if size:
            table.check_relative(where)
        return table

    def check_relative(self, where: str) -> None:
        """Refuse absolute paths and empty, "." or ".." components: a regex pass over the
        blob (a copy with "/" as NUL), block by block, not a Python loop per path."""
        n = len(self)
        for first in range(0, n, self.CHECK_BLOCK):
            last = min(n, first + self.CHECK_BLOCK)
            low, high = self.offsets.item(first), self.offsets.item(last) - 1
            # A NUL before the block's first path and after its last: every path is delimited.
            flat = (b"\0" + self.data[low:high] + b"\0").translate(_SLASH_TO_NUL)
            found = _UNSAFE_COMPONENT.search(flat)
            if found:
                # The match starts at the separator before the bad component (or empty path).
                bad = int(np.searchsorted(self.offsets, low + found.start(), side="right")) - 1
                raise CorruptDataError(f"{where}: path {bad} ({self[bad]!r}) is not a safe relative path (it is "
                                       "empty or absolute, or has an empty, '.' or '..' component); the dataset "
                                       "is damaged or was crafted: re-pack it from its source", where)

    def to_nul_separated(self) -> bytes:
        if not len(self):
            return b""
        return bytes(self.data[self.offsets.item(0):self.offsets.item(len(self)) - 1])

    def raw(self, i: int) -> bytes:
        return self.data[self.offsets.item(i):self.offsets.item(i + 1) - 1]

    def lengths(self) -> np.ndarray:
        """Each path's length in bytes (int64)."""
        return np.diff(self.offsets.astype(np.int64)) - 1

    def subset(self, keep: np.ndarray) -> "PathTable":
        """The paths where keep (a bool per path) is true, as a new table: one vectorised
        pass over the blob, not a Python string per path."""
        keep = np.asarray(keep, bool)
        if keep.all():
            return self
        if not keep.any():
            return PathTable(b"", np.zeros(1, np.int64))
        low, high = self.offsets.item(0), self.offsets.item(len(self)) - 1
        blob = np.frombuffer(self.data, np.uint8, high - low, low)
        # Each kept path's bytes and the NUL after it (the last path has none: cut below).
        mask = np.repeat(keep, self.lengths() + 1)[:high - low]
        kept = blob[mask].tobytes()
        if not keep[-1]:
            kept = kept[:-1]  # the NUL after the last kept path
        return PathTable(kept, path_offsets(kept, 0, len(kept)))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __reduce__(self):
        # A mapped table pickles as its bytes (a map cannot be pickled), already checked.
        return PathTable, (self.to_nul_separated(), self.offsets - self.offsets[0])


def path_offsets(raw, start: int, size: int, block: int = 1 << 18) -> np.ndarray:
    """Where each path of raw[start:start + size] (paths joined by NUL) starts, and one past
    the end of the last + 1: found block by block, so the temporaries stay a few MB however
    large the table. uint32 where every offset fits (half the memory), else int64."""
    dtype = np.uint32 if start + size + 1 < 2**32 else np.int64
    if not size:
        return np.array([start], dtype)  # an empty table, not one empty path
    blob = np.frombuffer(raw, np.uint8, size, start)
    ends = [(np.flatnonzero(blob[a:a + block] == 0) + (start + a + 1)).astype(dtype) for a in range(0, size, block)]
    return np.concatenate([np.array([start], dtype), *ends, np.array([start + size + 1], dtype)])


def split_name_problem(name) -> str | None:
    """Why name cannot be a split name, or None: it must be one plain folder name."""
    if not isinstance(name, str):
        return "is not a string"
    if not name:
        return "is empty"
    if name.startswith("."):
        return 'starts with "." (a hidden name, "." or "..")'
    if "/" in name or "\\" in name:
        return 'holds a "/" or "\\"'
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "holds a control character"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode text"
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes long, over {MAX_NAME_BYTES}"
    return None


def check_split_name(name, where: str = "split to write") -> None:
    """Refuse a split name that is not one plain folder name: splits become folders and keys."""
    problem = split_name_problem(name)
    if problem is not None:
        raise FormatError(f"{where}: split name {name!r} {problem}; a split name must be one plain "
                          "folder name (like train, val, test)", where)


def metadata_crc(obj: dict, container_keys: Sequence[str] = ()) -> int:
    """The "crc32" of a metadata object (the module docstring gives the recipe)."""
    rest = {k: v for k, v in obj.items() if k != "crc32" and k not in container_keys}
    text = json.dumps(rest, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return checksum(text.encode("utf-8", PATH_ENCODING_ERRORS))


def nesting(value) -> int:
    """How deeply lists and dicts nest in value, counted without recursion, stopping past MAX_NESTING."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_crc(d: dict, container_keys: Sequence[str]) -> None:
    if "crc32" not in d:
        unknown = sorted(set(d) - UNCHECKED_KEYS - set(container_keys))
        if unknown:  # a damaged "crc32" key, or a newer packer's fields without their checksum
            raise _Invalid(f"unknown key(s) {_show(unknown)} and no crc32")
        return
    stored = _count(d["crc32"], "crc32", 0xFFFFFFFF)
    try:
        actual = metadata_crc(d, container_keys)
    except UnicodeEncodeError as exc:  # a lone surrogate that no file name decodes to
        raise _Invalid(f"text that is not valid Unicode ({exc.reason})") from exc
    if stored != actual:
        raise _Invalid(f"checksum mismatch (crc32 says {stored:08x}, the content gives {actual:08x})")


def _split(name: str, s, n_classes: int) -> "SplitInfo":
    what = f"split {name!r}"
    if not isinstance(s, dict):
        raise _Invalid(f"{what} is {_show(s)}, not an object")
    for key in ("count", "bytes", "class_counts"):
        if key not in s:
            raise _Invalid(f"{what} has no {key!r}")
    count = _count(s["count"], f"{what} count", MAX_RECORDS)
    size = _count(s["bytes"], f"{what} bytes", MAX_BYTES)
    labeled = s.get("labeled", True)
    if not isinstance(labeled, bool):
        raise _Invalid(f"{what} labeled is {_show(labeled)}, not true or false")
    counts = s["class_counts"]
    if not isinstance(counts, list):
        raise _Invalid(f"{what} class_counts is {_show(counts)}, not a list")
    counts = [_count(c, f"{what} class count", MAX_RECORDS) for c in counts]
    if labeled and (len(counts) != n_classes or sum(counts) != count):
        raise _Invalid(f"{what} class_counts ({len(counts)} counts summing to {sum(counts)}) does not give "
                       f"one count per class ({n_classes}) summing to the split's {count} records")
    if not labeled and counts:
        raise _Invalid(f"{what} is unlabeled but has class counts")
    return SplitInfo(count, size, counts, labeled)


def _splits(value, n_classes: int) -> dict[str, "SplitInfo"]:
    if not isinstance(value, dict) or not value:
        raise _Invalid(f"splits is {_show(value)}, not an object naming at least one split")
    for name in value:
        problem = split_name_problem(name)
        if problem is not None:
            raise _Invalid(f"split name {name!r} {problem}; a split name must be one plain folder name")
    return {name: _split(name, s, n_classes) for name, s in value.items()}


@dataclass
class SplitInfo:
    count: int
    bytes: int
    class_counts: list[int]
    labeled: bool = True


@dataclass
class Metadata:
    """The dataset-level facts every format stores under its documented metadata key."""

    format: str  # the container: a name in packer.formats.FORMATS (lmdb, hdf5, wds)
    classes: list[str]
    splits: dict[str, SplitInfo]
    source: str = ""
    created: str = ""
    packer_version: str = ""
    params: dict = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    parts: dict | None = None  # a part, or a merge of parts (module docstring); None: packed in one piece
    reencode: dict | None = None  # records stored re-encoded (the module docstring), None: none
    checksum: str = record_checksums.LEGACY  # the kind of every record's checksum (packer.checksum)
    # Read back with a "crc32" that matched (every pack since metadata checksums): what
    # `--force` asks of a dataset before it replaces it (packer.replaceable). Not stored.
    sealed: bool = field(default=False, compare=False, repr=False)

    @property
    def written_version(self) -> int:
        """The format_version this metadata is written with: the oldest that reads it right."""
        return 1 if self.checksum == record_checksums.CRC32 else 2

    @property
    def count(self) -> int:
        return sum(s.count for s in self.splits.values())

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.splits.values())

    def to_dict(self) -> dict:
        """The metadata object, with its crc32; refused if from_dict would refuse it."""
        d = {
            "format": self.format,
            "format_version": self.written_version,
            "count": self.count,
            "bytes": self.bytes,
            "classes": list(self.classes),
            "splits": {
                name: {"count": s.count, "bytes": s.bytes, "labeled": s.labeled,
                       "class_counts": list(s.class_counts)}
                for name, s in self.splits.items()
            },
            "skipped": list(self.skipped),
            "source": redacted(self.source),  # a dataset is shared: no credential of a URL goes in
            "created": self.created,
            "packer_version": self.packer_version,
            "params": redacted(dict(self.params)),
        }
        if self.parts is not None:
            d["parts"] = self.parts
        if self.reencode is not None:  # absent otherwise: metadata without it reads as before
            d["reencode"] = self.reencode
            if isinstance(self.reencode, dict) and "form" in self.reencode:  # _parse refuses any other type
                d["reencode"] = {key: value for key, value in self.reencode.items() if key != "form"}
                d["reencode_form"] = self.reencode["form"]
        if self.checksum != record_checksums.LEGACY:  # absent: crc32, metadata as every packer wrote it
            d["checksum"] = self.checksum
        try:
            d["crc32"] = metadata_crc(d)
            self._parse(d, ())
            size = len(json.dumps(d, ensure_ascii=False))
            if size > MAX_WRITTEN_METADATA_BYTES:
                raise _Invalid(f"it would be {size} bytes, over the {MAX_WRITTEN_METADATA_BYTES} a dataset's "
                               "metadata may hold")
        except (_Invalid, ValueError, RecursionError) as exc:
            raise FormatError(f"cannot write this dataset's metadata: {exc}") from exc
        return d

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1).encode("utf-8", PATH_ENCODING_ERRORS)

    @classmethod
    def from_json(cls, raw, where: str) -> "Metadata":
        """Parse and check a metadata object stored as JSON text (bytes are UTF-8)."""
        if not isinstance(raw, (bytes, str)):
            raise FormatError(f"{where}: the packer metadata is a {type(raw).__name__}, not JSON text; "
                              "the dataset is damaged, re-pack it from its source", where)
        return cls.from_dict(parse_json(raw, where, "packer metadata"), where)

    @classmethod
    def from_dict(cls, d, where: str, container_keys: Sequence[str] = ()) -> "Metadata":
        """Check a parsed metadata object field by field and build it.

        container_keys: keys the container keeps beside the metadata in the same object
        (WDS: "wds"), left out of the checksum.
        """
        try:
            return cls._parse(d, container_keys, where)
        except _Invalid as exc:
            raise FormatError(f"{where}: bad packer metadata: {exc}; the dataset is damaged or was not written by "
                              "packer, re-pack it from its source", where) from exc

    @classmethod
    def _parse(cls, d, container_keys: Sequence[str], where: str = "") -> "Metadata":
        if not isinstance(d, dict):
            raise _Invalid(f"it is {_show(d)}, not a JSON object")
        if nesting(d) > MAX_NESTING:
            raise _Invalid(f"lists or objects nested over {MAX_NESTING} deep")
        version = d.get("format_version")
        newer = type(version) is int and version > FORMAT_VERSION
        try:
            _check_crc(d, container_keys)  # first: a flipped bit in the version is damage, not a newer pack
        except _Invalid as exc:
            if not newer:
                raise
            raise FormatError(f"{where}: written with format version {version}, this packer reads up to "
                              f"{FORMAT_VERSION} (upgrade packer to read it), or damaged ({exc})", where) from exc
        if newer:
            raise FormatError(f"{where}: written with format version {version}, this packer reads up to "
                              f"{FORMAT_VERSION} (upgrade packer to read it)", where)
        if _count(version, "format_version", FORMAT_VERSION) < 1:
            raise _Invalid("format_version is 0")
        kind = _checksum_kind(d.get("checksum", record_checksums.LEGACY), version, where)
        if not (isinstance(d.get("format"), str) and FORMAT_NAME.fullmatch(d["format"])):
            raise _Invalid(f"format is {_show(d.get('format'))}, not a format's name (lmdb, hdf5, wds, ...)")
        classes = _classes(d.get("classes"))
        splits = _splits(d.get("splits"), len(classes))
        for key, total in (("count", sum(s.count for s in splits.values())),
                           ("bytes", sum(s.bytes for s in splits.values()))):
            if key in d and d[key] != total:
                raise _Invalid(f"{key} is {_show(d[key])}, but the splits add up to {total}")
        return cls(format=d["format"], classes=classes, splits=splits,
                   source=_text(d.get("source", ""), "source"), created=_text(d.get("created", ""), "created"),
                   packer_version=_text(d.get("packer_version", ""), "packer_version"),
                   params=_params(d.get("params", {})), skipped=_skipped(d.get("skipped", [])),
                   format_version=version, parts=_parts(d["parts"], splits) if "parts" in d else None,
                    reencode=_reencode(d.get("reencode"), splits, d.get("reencode_form")), checksum=kind,
                    sealed="crc32" in d)


def parse_json(raw: bytes | str, where: str, what: str):
    """json.loads of at most MAX_METADATA_BYTES of text, any failure a FormatError naming where."""
    if len(raw) > MAX_METADATA_BYTES:
        raise FormatError(f"{where}: the {what} is {len(raw)} bytes, over the {MAX_METADATA_BYTES} packer reads; "
                          "the dataset is damaged or was not written by packer", where)
    try:
        return json.loads(raw.decode("utf-8", PATH_ENCODING_ERRORS) if isinstance(raw, bytes) else raw)
    except (ValueError, RecursionError) as exc:  # deep nesting: RecursionError, not a ValueError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise FormatError(f"{where}: the {what} is not valid JSON ({reason}); the dataset is damaged, "
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

