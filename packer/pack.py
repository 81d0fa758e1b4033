"""Packs a source folder into one format: parallel read + check, a single streaming writer.

Reader threads (processes for the decoding --check full) read and check files; the
parent receives them in write order and hands them to the format's Writer. The number
of files in flight is bounded, so memory stays flat however large the dataset is, and
nothing reaches OUT until the writer has finished (packer.output.staged).

The readers are packer.engine's; Ctrl-C stops a pack within moments and leaves nothing
behind (packer.interrupts). pack() builds the metadata once, from what the write loop
returns (Written): the source's classes and skipped folders, the splits and skipped files.

Write order is ImageFolder order, or with shuffling a seeded permutation of it per split
(write_order). The Writer protocol is unchanged either way: add() per sample in write
order, then end_split(labels, paths) with the kept samples in ImageFolder order; a
shuffled split also passes order=, the ImageFolder rank of each added sample
(packer.formats._contract has the whole protocol).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from . import __version__
from .check import CHECKS, MAX_PIXELS, problem
from .cores import available_cores
from .engine import load_in_processes, load_in_threads
from .errors import BadImageError, PackError
from .formats import FORMATS, default_output, format_named
from .formats._tables import array_chunks, drop_pages, spilled_array
from .interrupts import InterruptGuard
from .output import IO_ERRORS, check_target, staged, write_error
from .parts import cut_source, pack_in_parts, part_spec
from . import checksum as record_checksums
from .records import Metadata, SplitInfo
from .reencode import Reencode, reencode_image, reencode_spec
from .scan import ON_ERROR, Source, SplitListing, kept_paths, scan_source
from .source_io import read_regular_file


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


def load_file(job: str | Loaded, level: str, max_pixels: int = MAX_PIXELS,
              reencode: Reencode | None = None, kind: str = record_checksums.LEGACY) -> Loaded:
    """Read and check one file; errors become a reason, so the parent decides the policy.

    job is the file's path, or a Loaded already decided without opening it (a refused file).
    reencode: re-encode the file as packer.reencode says (over max_side, or not in the form asked for). kind: the
    record checksum kind to compute (packer.checksum).
    """
    if isinstance(job, Loaded):
        return job
    try:
        data = read_regular_file(job)
    except OSError as exc:
        return Loaded(None, 0, f"cannot read file ({exc.strerror or exc})")
    except BadImageError as exc:  # not a regular file, or changed while being read
        return Loaded(None, 0, exc.reason)
    reason = problem(data, level, max_pixels)
    if reason is not None:
        return Loaded(None, 0, reason)
    if reencode is not None:
        return loaded_under(reencode, data, max_pixels, kind)
    return Loaded(data, record_checksums.record_checksum(data, kind), None)


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


def pack(src: str, fmt: str = "lmdb", out: str | None = None, *, workers: int | None = None,
         on_error: str = "fail", check: str = "header", force: bool = False,
         progress: bool | None = None, options: dict | None = None,
         shuffle: bool | None = None, shuffle_seed: int = 0, max_pixels: int = MAX_PIXELS,
         labels: str | os.PathLike | None = None, labels_index_base: int | None = None,
         max_side: int | None = None, quality: int | None = None, baseline_420: bool = False,
         part=None, parts: int | None = None, executor=None,
         checksum: str = record_checksums.DEFAULT) -> PackResult:
    """Pack the ImageFolder tree at src into `fmt` at out (default: src + the format's extension).

    shuffle writes each split in a seeded permutation of ImageFolder order (shuffle_seed);
    None means the format's default (on for wds, off for lmdb and hdf5). The header and
    full checks refuse an image whose header claims more than max_pixels pixels
    (packer.check.MAX_PIXELS). labels, a label file, labels the flat (unlabeled) splits
    (packer.labels: shapes, and labels_index_base for a list of class indexes); its name
    and SHA-256 go into the metadata params. max_side re-encodes, as JPEGs at quality, the
    images whose upright long side is over it (packer.reencode), and baseline_420 those
    not already baseline 4:2:0 (or grayscale) JPEGs (packer.jpeg_form); every other image
    is stored byte for byte.

    Packing in parts (packer.parts, docs/parts.md): part="I/N" (or (I, N)) packs part I,
    counted from 0, of N, a dataset of its own that `packer merge` joins with the others
    (its default OUT: SRC.part-0000I-of-0000N + the format's extension). parts=N with
    executor=, any concurrent.futures.Executor (a Dask Client's get_executor(), mpi4py's
    MPIPoolExecutor...), runs the N parts on it and merges them into out; without an
    executor they run on local processes. Workers must see src and out's folder at the
    same paths.

    checksum: the kind of every record's checksum (packer.checksum): "xxh3", the default
    and the cheapest to check on each read, or "crc32", for other tools that check CRC-32.
    """
    record_checksums.check_kind(checksum)
    seed = shuffle_seed_for(fmt, shuffle, shuffle_seed)
    reencode = reencode_spec(max_side, quality, baseline_420)
    options = format_named(fmt).writer_options(options)
    if on_error not in ON_ERROR:
        raise PackError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
    if check not in CHECKS:
        raise PackError(f"check must be one of {', '.join(CHECKS)}, not {check!r}")
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise PackError(f"max_pixels must be a positive integer (default {MAX_PIXELS}), not {max_pixels!r}")
    if executor is not None or parts is not None:
        if part is not None:
            raise PackError("part= packs one part, parts= and executor= pack them all: pass one or the other")
        return pack_in_parts(src, fmt, out, parts=parts, executor=executor, force=force, progress=progress,
                             workers=workers, on_error=on_error, check=check, options=options, shuffle=shuffle,
                             shuffle_seed=shuffle_seed, max_pixels=max_pixels, labels=labels,
                             labels_index_base=labels_index_base, max_side=max_side, quality=quality,
                             baseline_420=baseline_420, checksum=checksum)
    spec = None if part is None else part_spec(part)
    start = time.perf_counter()
    out = os.path.abspath(out or (spec.output(src, fmt) if spec else default_output(src, fmt)))
    workers = workers or available_cores()
    with InterruptGuard(out) as guard:
        tidied = check_target(out, sources=[src], force=force)
        # The source's paths wait in an unlinked file beside OUT, mapped, not in memory.
        source = scan_source(src, on_error, labels, labels_index_base, spill_dir=os.path.dirname(out))
        cut = None
        if spec is not None:
            source, cut = cut_source(source, spec)
        params = {"format": fmt, "check": check, "on_error": on_error, "workers": workers, "max_pixels": max_pixels,
                  **options, "shuffle_seed": seed, **label_params(source, labels_index_base)}

        advice: list[str] = []  # the writer's (wds: too few shards for this machine)

        def fill(writer) -> Metadata:
            written = write_source(writer, source, check, on_error, workers, progress, seed, max_pixels, guard,
                                   reencode, checksum, spill_dir=os.path.dirname(out))
            advice.extend(written.warnings)
            return Metadata(format=fmt, classes=source.classes, splits=written.splits, source=source.root,
                            created=now_utc(), packer_version=__version__, params=params,
                            skipped=source.skipped + written.skipped,
                            parts=None if cut is None else cut.facts(source.splits, written.skipped),
                            reencode=None if reencode is None else reencode.record(written.reencoded),
                            checksum=checksum)

        meta = write_dataset(fmt, out, force, options, fill, checksum)
    return PackResult(out, meta, time.perf_counter() - start, tidied.notes + source.warnings + advice, tidied.removed)


def label_params(source: Source, index_base: int | None) -> dict:
    """The metadata params that record the label file applied, if any."""
    if source.labels is None:
        return {}
    found = source.labels.params()
    if source.labels.by_position is not None:
        found["index_base"] = index_base
    return {"labels": found}


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


def decodes_images(check: str, reencoding: bool) -> bool:
    """Whether a pack decodes its images (--check full, --max-side, --baseline-420): CPU-bound work, done in
    worker processes. Reading and the header check are I/O-bound: threads, which skip the
    pipe that processes send every file through."""
    return check == "full" or reencoding


def write_source(writer, source: Source, check: str, on_error: str, workers: int,
                 progress: bool | None, seed: int | None, max_pixels: int = MAX_PIXELS,
                 guard: InterruptGuard | None = None, reencode: Reencode | None = None,
                 kind: str = record_checksums.LEGACY, spill_dir: str | None = None) -> Written:
    """Stream every split of the source folder through writer, with checksums of kind.
    spill_dir: where the write orders wait, in unlinked files, mapped
    (packer.formats._tables.spilled_array)."""
    listings = {name: source.splits[name] for name in sorted(source.splits)}
    orders = {name: write_order(len(listing), name, seed) for name, listing in listings.items()}
    orders = {name: None if order is None else spilled_array(order, spill_dir) for name, order in orders.items()}
    jobs = source_jobs(source.root, listings, orders)
    load = functools.partial(load_file, level=check, max_pixels=max_pixels, reencode=reencode, kind=kind)
    load_in = load_in_processes if decodes_images(check, reencode is not None) else load_in_threads
    loaded = load_in(jobs, load, workers)
    return write_listings(writer, listings, len(source.classes), loaded, on_error, progress, orders, guard)


class SourceJobs:
    """load_file's jobs in write order, made as the engine asks for them: each file's path,
    or its refusal when it must not be opened. A sequence (len, index, slice), not a list
    of a million paths."""

    def __init__(self, root: str, listings: dict[str, SplitListing], orders: dict[str, np.ndarray | None]):
        self.root = root
        self.parts = [(listing, orders[name]) for name, listing in listings.items()]
        self.starts = np.cumsum([0] + [len(listing) for listing, _ in self.parts])
        self.looked_up = 0  # lookups since the listing's pages were last dropped (threads: roughly)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        part = int(np.searchsorted(self.starts, k, side="right")) - 1
        listing, order = self.parts[part]
        # The read-ahead looks up to WINDOW_FILES paths ahead of the writer, in shuffled order:
        # each lookup faults in pages around its path, so between the writer's drops (a shard
        # being synced) they could make the whole mapped path table resident. Dropped here too.
        self.looked_up += 1
        if self.looked_up >= RELEASE_EVERY:
            self.looked_up = 0
            release_listing(listing, order)
        j = k - int(self.starts[part])
        i = j if order is None else order.item(j)
        refused = listing.refused.get(i)
        return os.path.join(self.root, listing.paths[i]) if refused is None else Loaded(None, 0, refused)


def source_jobs(root: str, listings: dict[str, SplitListing], orders: dict[str, np.ndarray | None]) -> SourceJobs:
    """load_file's jobs in write order (SourceJobs)."""
    return SourceJobs(root, listings, orders)


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
