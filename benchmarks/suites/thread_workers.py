"""Thread workers against worker processes: make_loader's worker_kind side by side.

    python benchmarks/suites/thread_workers.py PACKED_LMDB [--workers 2] [--batch 64]
                                               [--batches 40] [--repeats 3] [--json out.json]

Each kind (processes, threads, threads-inline) reads the LMDB pack with decode="raw" and
readers.RandomResizedCrop(224, flip=0.5) through make_loader(workers=W) (W processes or W
threads: equal cores), warm, in a fresh process per run, the kinds interleaved round by
round (medians):
- first batch s: make_loader + iter() to the first batch (process start included);
- samples/s: the --batches batches after the first;
- CPU s/sample: user + system CPU of the trainer and every loader process over them;
- USS MB: private memory of the trainer and every loader process, summed, at the end;
- loader MB: the memory the loader added: the PSS (each page split among the processes
  mapping it) of the trainer and every loader process, summed, less the trainer's before
  make_loader. USS alone misleads here: a forked process's pages shared copy-on-write
  with the trainer leave both USS, so the sum of USS can fall as processes start;
  every process's USS is kept in the runs too;
- batch shm MB: resident shared memory holding batches (torch's segments, the thread ring),
  which no process's USS counts (part of loader MB);
- step slowdown: a fixed CPU-side step (Python arithmetic, as a training loop's host
  side is) timed with a batch taken after each, over the same step alone: the noisy
  neighbour, in-process threads against an isolated process.
--profile FILE writes a cProfile of one thread making --batches batches (readers.threads.fetch),
by own time: what is left in Python there holds the GIL, and bounds threads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KINDS = ("processes", "threads", "threads-inline")
STEP_LOOPS = 200_000  # the fixed step's work: a few ms of pure Python


def fixed_step() -> float:
    """Seconds of one fixed CPU-side step (holds the GIL throughout)."""
    start = time.perf_counter()
    total = 0
    for i in range(STEP_LOOPS):
        total += i * i % 7
    return time.perf_counter() - start


def loader_processes(me):
    """The trainer and every loader process under it."""
    return [me, *me.children(recursive=True)]


def cpu_seconds(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # a process gone meanwhile
            pass
    return total


def uss_mb(procs, field: str = "uss") -> float:
    total = 0
    for p in procs:
        try:
            total += getattr(p.memory_full_info(), field)
        except Exception:
            pass
    return total / 1e6


def batch_shm_mb(pid: int) -> float:
    """Resident memory of `pid`'s mappings of batch shared memory (torch's, the thread ring)."""
    total, counting = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                counting = "torch_" in line or "packer-batches" in line
            elif counting and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total / 1e6


def one(packed: str, kind: str, workers: int, batch: int, batches: int) -> dict:
    """One run of `kind`, in this (fresh) process."""
    import psutil

    from readers import LMDBDataset, RandomResizedCrop, make_loader

    me = psutil.Process()
    alone = statistics.median(fixed_step() for _ in range(15))
    data = LMDBDataset(packed, decode="raw", transform=RandomResizedCrop(224, flip=0.5))
    trainer_before = uss_mb([me], "pss")
    start = time.perf_counter()
    loader = make_loader(data, batch, workers=workers, worker_kind=kind)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    procs = loader_processes(me)
    cpu0, t0 = cpu_seconds(procs), time.perf_counter()
    samples = 0
    for _ in range(batches):
        images, _ = next(it)
        samples += len(images)
    wall = time.perf_counter() - t0
    procs = loader_processes(me)
    cpu, uss = cpu_seconds(procs) - cpu0, uss_mb(procs)
    each = [uss_mb([p]) for p in procs]
    shm = batch_shm_mb(me.pid)
    steps = []
    for _ in range(15):
        steps.append(fixed_step())
        next(it)
    del it
    return {"kind": kind, "first_batch_s": first, "samples_per_s": samples / wall, "cpu_s_per_sample": cpu / samples,
            "uss_mb": uss, "loader_mb": uss_mb(procs, "pss") - trainer_before, "uss_mb_each": each,
            "batch_shm_mb": shm, "loader_processes": len(procs), "step_slowdown": statistics.median(steps) / alone}


def profile(packed: str, batch: int, batches: int, path: str) -> None:
    """A cProfile, by own time, of one thread making `batches` batches as a thread worker does."""
    import cProfile
    import io
    import pstats

    import torch

    from readers import LMDBDataset, RandomResizedCrop, collate
    from readers.threads import fetch

    torch.set_num_threads(1)  # as in a thread worker
    data = LMDBDataset(packed, decode="raw", transform=RandomResizedCrop(224, flip=0.5))
    fetch(data, list(range(batch)), collate)  # opened and warm
    profiler = cProfile.Profile()
    profiler.enable()
    for b in range(1, batches + 1):
        fetch(data, list(range(b * batch, (b + 1) * batch)), collate)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    Path(path).write_text(out.getvalue())


def run(packed: str, kind: str, args) -> dict:
    cmd = [sys.executable, __file__, packed, "--one", kind, "--workers", str(args.workers), "--batch",
           str(args.batch), "--batches", str(args.batches)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def paired_ratios(rounds: dict, keys) -> dict:
    """Each kind's figures over processes' of the same round, median over the rounds: the
    machine's load drifts between rounds, less within one."""
    base = rounds.get("processes")
    if not base:
        return {}
    return {kind: {k: statistics.median(run[k] / ref[k] if ref[k] else float("nan") for run, ref in zip(runs, base))
                   for k in keys} for kind, runs in rounds.items() if kind != "processes"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("packed", help="an LMDB pack (the standard corpus: benchmarks/suites/corpus.py)")
    p.add_argument("--workers", type=int, default=2, help="processes, or threads: the cores given to loading")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--profile", help="write a cProfile of one thread worker here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.packed, args.one, args.workers, args.batch, args.batches)))
        return 0
    if args.profile:
        profile(args.packed, args.batch, args.batches, args.profile)
    kinds = args.kinds.split(",")
    rounds = {kind: [] for kind in kinds}
    for r in range(args.repeats):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            rounds[kind].append(run(args.packed, kind, args))
    keys = ("samples_per_s", "first_batch_s", "cpu_s_per_sample", "uss_mb", "loader_mb", "batch_shm_mb",
            "step_slowdown")
    print(f"{args.workers} workers, batches of {args.batch}, decode + RandomResizedCrop(224), warm, "
          f"{args.batches} batches a run, {args.repeats} rounds (medians); load average {os.getloadavg()[0]:.1f}")
    print(f"| kind | {' | '.join(keys)} |\n|---|{'---|' * len(keys)}")
    summary = {}
    for kind, runs in rounds.items():
        summary[kind] = {k: statistics.median(run[k] for run in runs) for k in keys}
        print(f"| {kind} | " + " | ".join(f"{summary[kind][k]:.4g}" for k in keys) + " |")
    ratios = paired_ratios(rounds, keys)
    for kind, ratio in ratios.items():
        print(f"| {kind} / processes (paired) | " + " | ".join(f"{ratio[k]:.3g}" for k in keys) + " |")
    load = os.getloadavg()[0]
    print(f"load average at the end {load:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "command": " ".join(sys.argv), "summary": summary,
                                               "ratios_to_processes": ratios, "load_average_end": load,
                                               "runs": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
