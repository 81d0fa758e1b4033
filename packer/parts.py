"""Packing one source in parts: a part's slice of the source, its fingerprint, and running
every part on a concurrent.futures Executor (then merging them, packer.merge).

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

pack_in_parts writes the parts in a staging folder beside OUT (OUT.partial-<owner>, the
name packer.output gives a staging path, so a run killed outright is tidied by the next
like any other), runs them on the executor, merges them into OUT and removes the folder.
Every worker must see SRC and that folder at the same paths: for several machines, a
shared file system.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

import numpy as np

from . import errors
from .cores import available_cores
from .engine import escape_warnings, stop_signals_blocked
from .errors import PackError
from .formats import FORMATS, default_output
from .formats._tables import drop_pages
from .interrupts import InterruptGuard, stop_when
from .output import HOST, PARTIAL, check_target, new_owner
from .records import MAX_PARTS, PathTable, part_bounds, split_bounds
from .scan import Source, SplitListing

STAT_CHUNK = 4096  # files per stat task of the fingerprint
STAT_THREADS = 8  # stats are I/O-bound, and on a network file system each one waits on a round trip
REMOVE_TRIES = 50  # a staging folder removed while a worker still writes in it may need a few passes


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


# Running the parts on an executor.


@dataclass(frozen=True)
class PartTask:
    """One part to pack, as sent to a worker: everything pack() needs, all picklable."""

    src: str
    fmt: str
    out: str
    spec: PartSpec
    options: dict


def part_task(src: str, fmt: str, folder: str, spec: PartSpec, options: dict) -> PartTask:
    """The task of one part, written in folder; a label file is named by its absolute path."""
    if options.get("labels") is not None:
        options = {**options, "labels": os.path.abspath(os.fspath(options["labels"]))}
    # force: the folder is this run's own, and a part may run again after it was written
    # (Dask recomputes a finished part whose result was held by a worker that died).
    return PartTask(src, fmt, os.path.join(folder, os.path.basename(spec.output(src, fmt))), spec,
                    {**options, "force": True})


def start_part_worker(stop, owner: int) -> None:
    """The initializer of the pack's own part processes (spawned): stop as their owner says
    (interrupts.stop_when), and print warnings escaped, as the command does."""
    escape_warnings()
    stop_when(stop, owner)


def run_part(task: PartTask) -> dict:
    """Pack one part on a worker. A PackError comes back as a value (not all of them pickle),
    so the coordinator can raise it again, naming the part."""
    from .pack import decodes_images, pack

    options, notes = task.options, []
    decoding = decodes_images(options.get("check", "header"),
                              options.get("max_side") is not None or bool(options.get("baseline_420")))
    if decoding and multiprocessing.current_process().daemon:
        # Decoding runs in processes, which a daemonic worker (Dask's, by default) may not start.
        options = {**options, "workers": 1}
        notes.append("--check full, --max-side and --baseline-420 decoded each part in its worker's own process, "
                     "which may not start others (daemonic): run more parts, or start Dask workers with "
                     "DASK_DISTRIBUTED__WORKER__DAEMON=False")
    try:
        result = pack(task.src, task.fmt, task.out, part=task.spec, progress=False, **options)
    except PackError as exc:
        return {"error": {"kind": type(exc).__name__, "message": str(exc), "path": exc.path}}
    return {"path": result.out, "count": result.metadata.count, "seconds": result.seconds,
            "warnings": result.warnings + notes, "host": HOST}


def part_error(spec: PartSpec, error: dict) -> PackError:
    """The PackError a worker reported for a part, of the same kind, its message naming the part."""
    kind = getattr(errors, str(error.get("kind")), PackError)
    if not (isinstance(kind, type) and issubclass(kind, PackError)):
        kind = PackError
    found = kind.__new__(kind)
    PackError.__init__(found, f"part {spec}: {error.get('message')}", error.get("path"))
    if isinstance(found, (errors.BadImageError, errors.CorruptDataError)):
        found.reason = error.get("message")
    return found


def executor_workers(executor: Executor) -> int:
    """How many tasks executor runs at once, where it says: concurrent.futures' pools, Dask's
    ClientExecutor (its cluster's threads), mpi4py's MPIPoolExecutor."""
    client = getattr(executor, "_client", None)
    if client is not None and hasattr(client, "nthreads"):
        return max(1, sum(client.nthreads().values()))
    for name in ("num_workers", "_max_workers"):
        found = getattr(executor, name, None)
        if isinstance(found, int) and found >= 1:
            return found
    raise PackError(f"cannot tell how many workers a {type(executor).__name__} has: pass parts=N")


def unique(lines: list[str]) -> list[str]:
    """lines without repeats, in order: each part reports the same scan warnings."""
    return list(dict.fromkeys(lines))


def remove_folder(folder: str) -> bool:
    """Remove folder and all in it, trying again while workers still write in it; whether it is gone."""
    for _ in range(REMOVE_TRIES):
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.lexists(folder):
            return True
        time.sleep(0.1)
    return False


def run_parts(executor: Executor, tasks: list[PartTask], guard: InterruptGuard) -> list[dict]:
    """Submit every task and wait for all of them. A failure cancels the parts not started
    and is raised as a PackError naming its part (the first by index, when several have
    failed by then, the others listed)."""
    with stop_signals_blocked():  # processes a pool starts here inherit the block (interrupts.stop_when)
        futures = {executor.submit(run_part, task): task for task in tasks}
    reports: dict[int, dict] = {}
    try:
        pending = set(futures)
        while pending:
            finished, pending = concurrent.futures.wait(pending, timeout=0.5,
                                                        return_when=concurrent.futures.FIRST_COMPLETED)
            guard.check()
            failures = {}
            for future in finished:
                task = futures[future]
                try:
                    reports[task.spec.index] = settled(future, task)
                except Exception as exc:  # a PackError, or a bug's own exception
                    failures[task.spec.index] = exc
            if failures:
                raise first_failure(failures, futures)
    finally:
        for future in futures:
            future.cancel()
    return [reports[task.spec.index] for task in tasks]


def first_failure(failures: dict[int, Exception], futures: dict) -> Exception:
    """The failure of the lowest part index, a bug's before any PackError (its traceback
    matters most), noting the other parts that failed by now."""
    for future, task in futures.items():
        if future.done() and not future.cancelled() and task.spec.index not in failures:
            try:
                settled(future, task)
            except Exception as exc:
                failures[task.spec.index] = exc
    bugs = [i for i in sorted(failures) if not isinstance(failures[i], PackError)]
    first = (bugs or sorted(failures))[0]
    others = [i for i in sorted(failures) if i != first]
    if others:
        say_also(failures[first], "also failed: " + ", ".join(f"part {i}" for i in others))
    return failures[first]


def say_also(exc: BaseException, text: str) -> None:
    """Add text to exc's message (a PackError's message is what the CLI prints), else as a note."""
    if isinstance(exc, PackError) and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}; {text}",) + exc.args[1:]
    else:
        exc.add_note(text)


def settled(future: concurrent.futures.Future, task: PartTask) -> dict:
    """A finished part's report, or the PackError that says how it failed (a bug's own exception
    is raised as it is, noted with its part)."""
    try:
        report = future.result()
    except concurrent.futures.CancelledError as exc:
        raise PackError(f"part {task.spec}: cancelled before it ran; nothing was written", task.out) from exc
    except concurrent.futures.BrokenExecutor as exc:  # which part's worker died, the pool cannot tell
        raise PackError(f"part {task.spec} ({task.out}): the executor broke while this part was running or "
                        f"waiting: one of its worker processes died ({type(exc).__name__}: {exc}); pack again",
                        task.out) from exc
    except Exception as exc:
        if type(exc).__name__ == "KilledWorker":  # Dask gave up on it: its workers kept dying
            raise PackError(f"part {task.spec} ({task.out}): its worker died ({type(exc).__name__}: {exc}); Dask "
                            "ran it again up to distributed.scheduler.allowed-failures times: see why the workers "
                            "died (memory, a lost machine), then pack again", task.out) from exc
        if isinstance(exc, OSError):  # the system's: a disk, a lost connection to a worker
            raise PackError(f"part {task.spec} ({task.out}): {type(exc).__name__} in its worker: {exc}; "
                            "pack again once that is mended", task.out) from exc
        exc.add_note(f"raised by part {task.spec} ({task.out}) in its worker")  # a bug: its traceback shows
        raise
    if "error" in report:
        raise part_error(task.spec, report["error"])
    return report


def pack_in_parts(src: str, fmt: str, out: str | None, *, parts: int | None, executor: Executor | None,
                  force: bool = False, progress: bool | None = None, workers: int | None = None,
                  **options):
    """Pack src as `parts` parts run on executor, then merge them into out (a PackResult).

    Without an executor, the parts run on a local pool of processes (at most the usable
    cores). parts defaults to the executor's workers. options are pack()'s, sent to every
    part; workers is each part's readers, and the merge's.
    """
    from .merge import merge

    start = time.perf_counter()
    if parts is None:
        parts = available_cores() if executor is None else executor_workers(executor)
    parts = parts_count(parts)
    src = os.path.abspath(os.fspath(src))
    out = os.path.abspath(out or default_output(src, fmt))
    own = stop = None
    if executor is None:
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        own = executor = concurrent.futures.ProcessPoolExecutor(
            min(parts, available_cores()), mp_context=context, initializer=start_part_worker,
            initargs=(stop, os.getpid()))
    # The guard spans the pool's shutdown too: once the merge has published OUT, a stop
    # signal waits (interrupts.hold_stops) until the folder is gone and the pool is down.
    with InterruptGuard(out) as guard:
        try:
            tidied = check_target(out, sources=[src], force=force)
            folder = new_owner().path(out, PARTIAL)
            os.mkdir(folder)
            try:
                tasks = [part_task(src, fmt, folder, PartSpec(i, parts), {**options, "workers": workers})
                         for i in range(parts)]
                reports = run_parts(executor, tasks, guard)
                result = merge([report["path"] for report in reports], out, force=force, workers=workers,
                               progress=progress)
            except BaseException as exc:
                if own is not None:  # its running parts stop, and end, before their folder goes
                    stop.set()
                    own.shutdown(wait=True, cancel_futures=True)
                if not remove_folder(folder):
                    say_also(exc, f"{folder}, the parts' staging folder, could not be removed: remove it "
                                  f"(rm -rf '{folder}')")
                raise
            if not remove_folder(folder):
                raise PackError(f"{folder}: could not remove the parts' staging folder after the merge; remove "
                                f"it (rm -rf '{folder}')", folder)
        finally:
            if own is not None:
                own.shutdown(wait=True, cancel_futures=True)
    part_warnings = unique([warning for report in reports for warning in report["warnings"]])
    result.warnings = tidied.notes + part_warnings + result.warnings
    result.removed_stale = tidied.removed + result.removed_stale
    result.seconds = time.perf_counter() - start
    return result
