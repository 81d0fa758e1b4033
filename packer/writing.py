"""The writer path that pack, convert and merge share: a format's Writer driven over loaded
records, split by split, into a staging path published at OUT, and the PackResult it makes.

Write order is ImageFolder order, or with shuffling a seeded permutation of it per split
(write_order). The Writer protocol is unchanged either way: add() per sample in write
order, then end_split(labels, paths) with the kept samples in ImageFolder order; a
shuffled split also passes order=, the ImageFolder rank of each added sample
(packer.formats._contract has the whole protocol). Nothing reaches OUT until the writer
has finished (packer.output.staged); Ctrl-C stops the loop at the next record
(packer.interrupts).
"""
from __future__ import annotations

import contextlib
import datetime
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from . import checksum as record_checksums
from .errors import BadImageError, PackError
from .formats import FORMATS, format_named
from .formats._tables import array_chunks, drop_pages
from .interrupts import InterruptGuard
from .output import IO_ERRORS, staged, write_error
from .records import Metadata, SplitInfo
from .reencode import Reencode, reencode_image
from .scan import SplitListing, kept_paths


# Records written between two drops of the pages the mapped tables (paths, offsets, labels,
# order) have had read (write_split). Small: each fault on a map brings in the pages around
# it (the kernel's fault-around, 64 KB), so shuffled reads make 16 pages resident apiece.
RELEASE_EVERY = 32


@dataclass
class Loaded:
    """One source file after reading and checking, as the writer receives it."""

    data: bytes | None
    crc: int
    reason: str | None
    reencoded: bool = False  # data is the source re-encoded (--max-side), not its bytes


@dataclass
class Written:
    """What the write loop returns: each split's facts and the files it left out."""

    splits: dict[str, SplitInfo]
    skipped: list[dict]
    warnings: list[str] = field(default_factory=list)  # the writer's advice (Writer.warnings, optional)
    reencoded: dict[str, int] = field(default_factory=dict)  # per split: records written re-encoded


@dataclass
class PackResult:
    out: str
    metadata: Metadata
    seconds: float
    warnings: list[str] = field(default_factory=list)
    removed_stale: list[str] = field(default_factory=list)

    @property
    def files_per_s(self) -> float:
        return self.metadata.count / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.metadata.bytes / 1e6 / max(self.seconds, 1e-9)


def loaded_under(spec: Reencode, data: bytes, max_pixels: int, kind: str = record_checksums.LEGACY) -> Loaded:
    """data as stored under spec: re-encoded when spec says so, else as it is; with its
    checksum of kind."""
    try:
        smaller = reencode_image(data, spec, max_pixels)
    except BadImageError as exc:
        return Loaded(None, 0, exc.reason)
    if smaller is None:
        return Loaded(data, record_checksums.record_checksum(data, kind), None)
    return Loaded(smaller, record_checksums.record_checksum(smaller, kind), None, reencoded=True)


class Progress:
    """tqdm bar on a terminal (files/s and MB/s), silent otherwise."""

    def __init__(self, total: int, enabled: bool | None):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="file", disable=None if enabled is None else not enabled,
                        smoothing=0.1, dynamic_ncols=True)
        self.bytes = 0
        self.start = self.last = time.perf_counter()

    def update(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.last > 0.5:
            self.last = now
            self.bar.set_postfix_str(f"{self.bytes / 1e6 / (now - self.start):.0f} MB/s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def write_order(count: int, split: str, seed: int | None) -> np.ndarray | None:
    """The seeded permutation of range(count) that split is written in, or None (ImageFolder order).

    numpy's PCG64 seeded with (seed, CRC-32 of the split name): reproducible, and each
    split gets its own permutation.
    """
    if seed is None:
        return None
    order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(count)
    return order.astype(np.int32) if count < 2**31 else order  # half the memory, the same values


def shuffle_seed_for(fmt: str, shuffle: bool | None, shuffle_seed: int) -> int | None:
    """The seed fmt is written shuffled with, or None for ImageFolder order.

    shuffle=None means the format's default (Format.shuffled_by_default: on for wds, off
    for lmdb and hdf5); a format whose writer cannot store a permutation is refused.
    """
    target = format_named(fmt)
    if shuffle and not target.writes_shuffled:
        shufflers = [name for name, f in FORMATS.items() if f.writes_shuffled]
        raise PackError(f"{fmt} cannot be written shuffled (shuffled writing applies to: {', '.join(shufflers)})")
    seed = shuffle_seed if (target.shuffled_by_default if shuffle is None else shuffle) else None
    if seed is not None and seed < 0:
        raise PackError(f"shuffle_seed must be a non-negative integer, not {seed}")
    return seed


def write_dataset(fmt: str, out: str, force: bool, options: dict | None,
                  fill: Callable[[Any], Metadata], checksum: str = record_checksums.LEGACY) -> Metadata:
    """Create a `fmt` Writer on a staging path, fill(writer) it, finish it and publish it at out.

    options are the writer's, checked (Format.writer_options); the writer is also told the
    record checksum kind its records' crcs are of (checksum). On any error the writer is
    aborted and nothing appears at out (packer.output.staged). An I/O error becomes a
    PackError that says what failed; anything else (a bug) is raised as it is.
    """
    target = format_named(fmt)
    options = target.writer_options(options)
    try:
        with staged(out, force, directory=target.directory) as stage:
            return fill_writer(target.Writer, stage, {**options, "checksum": checksum}, fill)
    except IO_ERRORS as exc:
        raise write_error(exc, out, fmt) from exc


def fill_writer(make_writer: Callable[[str, dict], Any], stage: str, options: dict | None,
                fill: Callable[[Any], Metadata]) -> Metadata:
    writer = None
    try:
        writer = make_writer(stage, options or {})
        meta = fill(writer)
        writer.finish(meta)
    except BaseException:
        if writer is not None:
            with contextlib.suppress(*IO_ERRORS):  # the error that stopped the write is the one to report
                writer.abort()
        raise
    return meta


def split_order(count: int, order: np.ndarray | None, block: int = 1 << 16):
    """The ImageFolder indexes of a split in the order they are written (a block of Python
    ints at a time, not a list of them all)."""
    if order is None:
        return range(count)
    return (i for start in range(0, count, block) for i in order[start:start + block].tolist())


def write_listings(writer, listings: dict[str, SplitListing], n_classes: int, loaded: Iterator[Loaded],
                   on_error: str, progress: bool | None, orders: dict[str, np.ndarray | None] | None = None,
                   guard: InterruptGuard | None = None) -> Written:
    """Write each split's records, taking their bytes from loaded in write order.

    guard (see InterruptGuard) is checked at every record and once more at the end.
    """
    orders = orders or {}
    guard = guard or InterruptGuard()
    bar = Progress(sum(len(listing) for listing in listings.values()), progress)
    skipped: list[dict] = []
    splits: dict[str, SplitInfo] = {}
    tally = ReencodeTally(loaded)
    reencoded: dict[str, int] = {}
    try:
        for name, listing in listings.items():
            before = tally.count
            splits[name] = write_split(writer, name, listing, n_classes, tally, on_error, skipped, bar,
                                       orders.get(name), guard)
            reencoded[name] = tally.count - before
    finally:
        bar.close()
        loaded.close()
    guard.check()
    return Written(splits, skipped, list(getattr(writer, "warnings", ())), reencoded)


class ReencodeTally:
    """The loaded records passed through, counting those that were re-encoded."""

    def __init__(self, loaded: Iterator[Loaded]):
        self.loaded, self.count = loaded, 0

    def __iter__(self):
        return self

    def __next__(self) -> Loaded:
        item = next(self.loaded)
        self.count += item.reencoded
        return item


def write_split(writer, name: str, listing: SplitListing, n_classes: int, loaded: Iterator[Loaded],
                on_error: str, skipped: list[dict], bar: Progress, order: np.ndarray | None,
                guard: InterruptGuard) -> SplitInfo:
    writer.begin_split(name, expected_count=len(listing))
    kept = np.ones(len(listing), dtype=bool)
    nbytes = 0
    first_skipped = len(skipped)
    for k, i in enumerate(split_order(len(listing), order)):
        if k % RELEASE_EVERY == RELEASE_EVERY - 1:
            release_listing(listing, order)
        relpath = listing.paths[i]
        item = next(loaded)
        guard.check()
        if item.reason is not None:
            if on_error == "fail":
                raise BadImageError(relpath, f"{item.reason} (pass --on-error skip to leave it out, "
                                             "or fix or remove the file)")
            skipped.append({"path": relpath, "split": name, "reason": item.reason})
            kept[i] = False
            bar.update(0)
            continue
        label = int(listing.labels[i])
        writer.add(item.data, label, relpath, item.crc)
        nbytes += len(item.data)
        bar.update(len(item.data))
    all_kept = bool(kept.all())
    labels = listing.labels if all_kept else listing.labels[kept]
    paths = kept_paths(listing.paths, kept, listing.spill_dir)
    if order is not None:  # list skipped files in ImageFolder order whatever the write order
        skipped[first_skipped:] = [skipped[first_skipped:][j] for j in np.argsort(order[~kept[order]])]
    release_listing(listing, order)
    if order is None:
        writer.end_split(labels, paths)
    else:
        writer.end_split(labels, paths, order=kept_order(order, kept))
    counts = class_counts(labels, n_classes) if listing.labeled else np.zeros(0)
    return SplitInfo(int(kept.sum()), nbytes, [int(c) for c in counts], listing.labeled)


def class_counts(labels: np.ndarray, n_classes: int) -> np.ndarray:
    """How many of labels name each class (-1 counts for none), a block at a time."""
    counts = np.zeros(n_classes, np.int64)
    for block in array_chunks(labels):
        counts += np.bincount(block[block >= 0], minlength=n_classes)[:n_classes]
    return counts


def release_listing(listing: SplitListing, order: np.ndarray | None) -> None:
    """Drop the pages of a listing's spilled tables read so far: page cache, not this process's RSS."""
    for table in (listing.paths.data, listing.paths.offsets, listing.labels, order):
        drop_pages(table)


def kept_order(order: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The write order among the kept samples: for each kept sample in write order, its index
    among the kept ones in ImageFolder order (order itself when all were kept)."""
    if kept.all():
        return order
    dtype = np.int32 if len(kept) < 2**31 else np.int64
    rank = (np.cumsum(kept, dtype=dtype) - 1).astype(dtype)  # ImageFolder position -> index among the kept
    return rank[order[kept[order]]]


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
