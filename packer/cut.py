"""A part's cut of a source: which part (PartSpec, "I/N"), the slice of the source it holds, and
the source's fingerprint that tells parts of one source from parts of another.

Part I of N (I counted from 0, as $SLURM_ARRAY_TASK_ID and $JOB_COMPLETION_INDEX count)
holds a contiguous range of the whole source in the order a single pack writes it: the
splits in sorted name order, one after the other, each in ImageFolder order
(packer.records.part_bounds and split_bounds give the ranges). A part keeps every split
and the whole class list, so its labels are the source's, and it is a complete dataset
of its own; its metadata says which slice of which source it holds (the "parts" object of
packer.records). Shuffled writing (wds) shuffles a part within itself; the merge writes
the whole in the single pack's order, so a merge equals a single pack of the source.

The source's fingerprint covers what decides that order and those labels: the class
list, each split's name and whether it is labeled, every listed file's relative path,
label and size (one stat per file, streamed through a few threads, hashed as they come),
and the folders left out of the scan. Every part computes it over the whole source, so
merge can tell parts of one source from parts of another, or of the same one changed in
between.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import PackError
from .formats import FORMATS
from .formats._tables import drop_pages
from .records import MAX_PARTS, PathTable, part_bounds, split_bounds
from .scan import Source, SplitListing
from .staging import HOST

STAT_CHUNK = 4096  # files per stat task of the fingerprint
STAT_THREADS = 8  # stats are I/O-bound, and on a network file system each one waits on a round trip


@dataclass(frozen=True)
class PartSpec:
    """Part index (from 0) of count."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def output(self, src: str, fmt: str) -> str:
        """The default OUT of a part: SRC.part-00002-of-00008.lmdb beside SRC."""
        base = os.path.abspath(os.fspath(src)).rstrip(os.sep)
        return f"{base}.part-{self.index:05d}-of-{self.count:05d}{FORMATS[fmt].extension}"


def part_spec(value) -> PartSpec:
    """A PartSpec from "I/N", a (I, N) pair or a PartSpec; PackError saying what is wrong otherwise."""
    if isinstance(value, PartSpec):
        index, count = value.index, value.count
    elif isinstance(value, str):
        index_text, slash, count_text = value.partition("/")
        if not (slash and index_text.strip().isdigit() and count_text.strip().isdigit()):
            raise PackError(f"part {value!r}: give it as I/N, part I (counted from 0) of N, e.g. 0/4 ... 3/4")
        index, count = int(index_text), int(count_text)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        index, count = value
    else:
        raise PackError(f"part {value!r}: give it as I/N or as a pair (I, N)")
    for number in (index, count):
        if isinstance(number, bool) or not isinstance(number, int):
            raise PackError(f"part {value!r}: I and N must be whole numbers")
    if not 1 <= count <= MAX_PARTS:
        raise PackError(f"part {value!r}: N must be from 1 to {MAX_PARTS}")
    if not 0 <= index < count:
        raise PackError(f"part {value!r}: I counts from 0, so it must be from 0 to {count - 1} (with SLURM, "
                        "--array=0-(N-1) and --part $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    return PartSpec(index, count)


def parts_count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PARTS:
        raise PackError(f"parts must be a whole number from 1 to {MAX_PARTS}, not {value!r}")
    return value


def file_sizes(root: str, paths: PathTable, start: int, stop: int) -> np.ndarray:
    """The sizes of paths[start:stop] (symlinks followed, as reading does); -1 for one that
    cannot be stat'ed (it fails, or is skipped, when read)."""
    sizes = np.empty(stop - start, dtype="<i8")
    for j in range(start, stop):
        try:
            sizes[j - start] = os.stat(os.path.join(root, paths[j])).st_size
        except OSError:
            sizes[j - start] = -1
    return sizes


def hash_in_pieces(digest, data, piece: int = 1 << 24) -> None:
    """digest.update(data) a piece at a time, a mapped table's pages dropped after each, so
    hashing a 1.28M-path table does not leave it all resident."""
    with memoryview(data) as view:  # released at once: a live view would keep a map from closing
        for start in range(0, len(view), piece):
            digest.update(view[start:start + piece])
            drop_pages(data)


def source_fingerprint(source: Source, threads: int = STAT_THREADS) -> str:
    """SHA-256 of what decides a pack of source: classes, splits, paths, labels, sizes, skipped folders."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"classes": source.classes, "skipped": source.skipped}, sort_keys=True,
                             ensure_ascii=False).encode("utf-8", "surrogateescape"))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for name in sorted(source.splits):
            listing = source.splits[name]
            digest.update(json.dumps([name, listing.labeled, len(listing)]).encode())
            hash_in_pieces(digest, listing.paths.data)
            digest.update(np.asarray(listing.labels, dtype="<i4").tobytes())
            chunks = range(0, len(listing), STAT_CHUNK)
            for sizes in pool.map(lambda i: file_sizes(source.root, listing.paths, i,
                                                       min(i + STAT_CHUNK, len(listing))), chunks):
                digest.update(sizes.tobytes())
            for table in (listing.paths.data, listing.paths.offsets, listing.labels):
                drop_pages(table)  # tables pack spilled to files: touched whole here, not kept resident
    return "sha256:" + digest.hexdigest()


def slice_paths(paths: PathTable, start: int, stop: int) -> PathTable:
    if start == stop:
        return PathTable.from_strings([])
    offsets = paths.offsets[start:stop + 1]
    return PathTable(paths.data[offsets[0]:offsets[-1]], offsets - offsets[0])


def slice_listing(listing: SplitListing, start: int, stop: int) -> SplitListing:
    refused = {i - start: why for i, why in listing.refused.items() if start <= i < stop}
    return SplitListing(slice_paths(listing.paths, start, stop), np.array(listing.labels[start:stop]),
                        listing.labeled, refused)


@dataclass
class Cut:
    """What a part holds of its source: the facts its metadata records, less what writing decides."""

    spec: PartSpec
    fingerprint: str
    total: int
    start: int
    stop: int
    splits: dict[str, dict] = field(default_factory=dict)  # name -> listed, start, stop

    def facts(self, listings: dict[str, SplitListing], skipped: list[dict]) -> dict:
        """The metadata "parts" object, given the part's listings and the files writing left out."""
        splits = {}
        for name, bounds in self.splits.items():
            left_out = {entry["path"] for entry in skipped if entry.get("split") == name}
            at = ([i for i, path in enumerate(listings[name].paths) if path in left_out] if left_out else [])
            splits[name] = {**bounds, "skipped_at": at}
        return {"fingerprint": self.fingerprint, "count": self.spec.count, "index": self.spec.index,
                "host": HOST, "total": self.total, "start": self.start, "stop": self.stop, "splits": splits}


def cut_source(source: Source, spec: PartSpec) -> tuple[Source, Cut]:
    """The part of source that spec names, as a Source of its own, and what it holds."""
    listed = {name: len(listing) for name, listing in source.splits.items()}
    total = sum(listed.values())
    start, stop = part_bounds(total, spec.index, spec.count)
    cut = Cut(spec, source_fingerprint(source), total, start, stop)
    splits = {}
    for name, (first, end) in split_bounds(listed, start, stop).items():
        splits[name] = slice_listing(source.splits[name], first, end)
        cut.splits[name] = {"listed": listed[name], "start": first, "stop": end}
    return replace(source, splits=splits), cut
