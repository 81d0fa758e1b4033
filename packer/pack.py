"""Packs a source folder into one format: parallel read + check, a single streaming writer.

Worker processes read and check files; the parent receives them in ImageFolder order and
hands them to the format's Writer. The number of files in flight is bounded, so memory
stays flat however large the dataset is, and nothing reaches OUT until the writer has
finished (packer.output.staged).
"""
from __future__ import annotations

import datetime
import functools
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import Pool
from typing import Callable, Iterator

import numpy as np

from . import __version__
from .check import CHECKS, problem
from .errors import BadImageError, PackError
from .formats import FORMATS, default_output
from .output import remove_stale, staged
from .records import Metadata, PathTable, SplitInfo, checksum
from .scan import Source, SplitListing, scan_source

ON_ERROR = ("fail", "skip")
CHUNK = 16  # files per task sent to a worker: amortises IPC without hurting order latency


@dataclass
class Loaded:
    """One source file after reading and checking, as the writer receives it."""

    data: bytes | None
    crc: int
    reason: str | None


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


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_file(path: str, level: str) -> Loaded:
    """Read and check one file; errors become a reason, so the parent decides the policy."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return Loaded(None, 0, f"cannot read file ({exc.strerror or exc})")
    reason = problem(data, level)
    if reason is not None:
        return Loaded(None, 0, reason)
    return Loaded(data, checksum(data), None)


def load_in_order(paths: list[str], level: str, workers: int) -> Iterator[Loaded]:
    """Loaded files in input order, read by `workers` processes with bounded look-ahead."""
    load = functools.partial(load_file, level=level)
    if workers <= 1:
        yield from map(load, paths)
        return
    window = threading.BoundedSemaphore(workers * CHUNK * 4)

    def feed():
        for p in paths:
            window.acquire()  # Pool's feeder thread blocks here: no unbounded read-ahead
            yield p

    pool = Pool(workers)
    try:
        for loaded in pool.imap(load, feed(), chunksize=CHUNK):
            window.release()
            yield loaded
        pool.close()
    finally:
        pool.terminate()
        pool.join()


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


def pack(src: str, fmt: str = "lmdb", out: str | None = None, *, workers: int | None = None,
         on_error: str = "fail", check: str = "header", force: bool = False,
         progress: bool | None = None, options: dict | None = None) -> PackResult:
    """Pack the ImageFolder tree at src into `fmt` at out (default: src + the format's extension)."""
    if fmt not in FORMATS:
        raise PackError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if on_error not in ON_ERROR:
        raise PackError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
    if check not in CHECKS:
        raise PackError(f"check must be one of {', '.join(CHECKS)}, not {check!r}")
    start = time.perf_counter()
    module = FORMATS[fmt]
    out = os.path.abspath(out or default_output(src, fmt))
    workers = workers or default_workers()
    removed = remove_stale(out)
    source = scan_source(src)
    params = {"format": fmt, "check": check, "on_error": on_error, "workers": workers, **(options or {})}
    with staged(out, force, directory=module.DIRECTORY) as stage:
        writer = None
        try:
            writer = module.Writer(stage, options or {})
            meta = write_source(writer, source, check, on_error, workers, progress,
                                lambda skipped, splits: Metadata(
                                    format=fmt, classes=source.classes, splits=splits, source=source.root,
                                    created=now_utc(), packer_version=__version__, params=params,
                                    skipped=skipped))
            writer.finish(meta)
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            if isinstance(exc, Exception) and not isinstance(exc, PackError):
                # Disk full, quota, I/O error: say where, and that OUT was left untouched.
                raise PackError(f"{out}: writing the {fmt} dataset failed ({type(exc).__name__}: {exc}); "
                                "nothing was written at OUT (free some space or choose -o elsewhere)",
                                out) from exc
            raise
    return PackResult(out, meta, time.perf_counter() - start, source.warnings, removed)


def write_source(writer, source: Source, check: str, on_error: str, workers: int,
                 progress: bool | None, make_metadata: Callable[[list, dict], Metadata]) -> Metadata:
    """Stream every split of source through writer; return the metadata to store."""
    names = sorted(source.splits)
    all_paths = [os.path.join(source.root, p) for n in names for p in source.splits[n].paths]
    loaded = load_in_order(all_paths, check, workers)
    bar = Progress(len(all_paths), progress)
    skipped: list[dict] = []
    splits: dict[str, SplitInfo] = {}
    try:
        for name in names:
            splits[name] = write_split(writer, name, source.splits[name], len(source.classes),
                                       loaded, on_error, skipped, bar)
    finally:
        bar.close()
        loaded.close()
    return make_metadata(skipped, splits)


def write_split(writer, name: str, listing: SplitListing, n_classes: int, loaded: Iterator[Loaded],
                on_error: str, skipped: list[dict], bar: Progress) -> SplitInfo:
    writer.begin_split(name)
    kept = np.ones(len(listing), dtype=bool)
    nbytes = 0
    for i, relpath in enumerate(listing.paths):
        item = next(loaded)
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
    labels = listing.labels[kept]
    paths = PathTable.from_strings(p for p, k in zip(listing.paths, kept) if k)
    writer.end_split(labels, paths)
    counts = np.bincount(labels[labels >= 0], minlength=n_classes) if listing.labeled else np.zeros(0)
    return SplitInfo(int(kept.sum()), nbytes, [int(c) for c in counts], listing.labeled)


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
