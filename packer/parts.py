"""Packing one source in parts: every part (packer.cut) packed on a concurrent.futures Executor,
then merged (packer.merge) into the dataset a single pack gives.

pack_in_parts writes the parts in a staging folder beside OUT (OUT.partial-<owner>, the
name packer.output gives a staging path, so a run killed outright is tidied by the next
like any other), runs them on the executor, merges them into OUT and removes the folder.
Every worker must see SRC and that folder at the same paths: for several machines, a
shared file system.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import shutil
import time
from concurrent.futures import Executor
from dataclasses import dataclass

from . import errors
from .cores import available_cores
from .cut import PartSpec, parts_count
from .engine import escape_warnings, stop_signals_blocked
from .errors import PackError
from .formats import default_output
from .interrupts import InterruptGuard, stop_when
from .merge import merge
from .pack import decodes_images, pack
from .staging import HOST, PARTIAL, new_owner

REMOVE_TRIES = 50  # a staging folder removed while a worker still writes in it may need a few passes


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
        add_note(exc, text)


def add_note(exc: BaseException, text: str) -> None:
    """exc.add_note(text) on Python 3.11+; on 3.10, which lacks it, the same entry in
    exc.__notes__, which 3.11's tracebacks print and 3.10's leave to the code that reads it."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), text]


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
        add_note(exc, f"raised by part {task.spec} ({task.out}) in its worker")  # a bug: its traceback shows
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
    result.warnings = part_warnings + result.warnings
    result.seconds = time.perf_counter() - start
    return result
