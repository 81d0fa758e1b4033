"""Thread workers against worker processes: make_loader's worker_kind side by side.

    python benchmarks/suites/thread_workers.py PACKED_LMDB [--workers 2] [--batch 64]
                                               [--batches 40] [--repeats 3] [--steps 15] [--json out.json]

Each kind (processes, threads, threads-inline) reads the LMDB pack with decode="raw" and
readers.RandomResizedCrop(224, flip=0.5) through make_loader(workers=W) (W processes or W
threads: equal cores), warm, in a fresh process per run, the kinds interleaved round by
round (medians):
- first batch s: make_loader + iter() to the first batch (process start included);
- samples/s: the --batches batches after the first;
- CPU s/sample: user + system CPU of the trainer and every loader process over them.
The trainer reads every byte of each batch's images, as a training step does (copied
into a tensor of its own, made once after the loader's processes fork, the same for
every kind). A trainer that never reads its batches leaves a thread ring's pages private
to the background process, where a worker process's batch leaves it once sent.
Memory, at the end of those batches (the trainer holding the last one):
- loader USS MB: the private memory (USS) of every process of the loader,
  summed: the W worker processes, or the one background process of threads (none for
  threads-inline, whose cost is all the trainer's). It is what ending them would free.
  A batch on its way differs: a worker process's is a descriptor held with no mapping,
  in no USS; a ring slot the trainer has not yet read is the background process's own.
  With a trainer that reads each batch as it comes, few are;
- trainer added USS MB: the trainer's USS less its own before make_loader. Negative under
  fork: the trainer's pages the forked processes share copy-on-write leave its USS (and
  are in theirs only once either writes them), so it says little alone;
- trainer added anon MB: the trainer's resident anonymous memory (heap, arenas) less its
  own before make_loader, which that sharing does not move: its own tensor above (one
  batch) and what receiving batches costs it; batches themselves are counted below;
- USS MB: the USS of the trainer and every loader process, summed (libraries' pages
  count as private to whichever process alone maps them at the moment, so the trainer's
  moves by tens of MB with what else runs on the machine; compare the paired ratios);
- loader MB: the PSS (each page split among the processes mapping it) of the trainer and
  every loader process, summed, less the trainer's before make_loader: every page the
  loader added counted once, batches in the trainer's mappings included;
- batch shm MB: resident batch shared memory (torch's segments, the thread ring) in the
  trainer's mappings: in no process's USS once two map it;
- batch memory MB: every batch segment alive in the trainer and the loader's processes,
  each once, mapped or only held by a descriptor (a worker process's batch on its way):
  the ring's every written slot, or processes' batches in flight and held;
- step slowdown: a fixed CPU-side step (Python arithmetic, as a training loop's host
  side is) timed with a batch taken after each, over the same step alone, --steps times
  each (medians): the noisy neighbour, in-process threads against an isolated process.
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
    """The loader's processes: every process under the trainer (its workers, or the
    threads' background process; none for threads-inline)."""
    return me.children(recursive=True)


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


def is_batch_memory(name: str) -> bool:
    return "torch_" in name or "packer-batches" in name


def mappings(pid: int):
    """(path, inode, {field: bytes}) of each of `pid`'s mappings, from /proc/PID/smaps."""
    found, fields = [], None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                fields = {}
                found.append((" ".join(parts[5:]), int(parts[4]), fields))
            elif len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return found


def batch_shm_mb(pid: int) -> float:
    """Resident memory of `pid`'s mappings of batch shared memory (torch's, the thread ring)."""
    return sum(f.get("Rss", 0) for path, _, f in mappings(pid) if is_batch_memory(path)) / 1e6


def batch_memory_mb(pids) -> float:
    """Every batch shared-memory segment alive in these processes, each counted once: mapped
    (its resident pages) or only held open (its allocated pages: a worker process's batch
    on its way to the trainer is a descriptor with no mapping, which no USS or PSS counts)."""
    held = {}
    for pid in pids:
        try:
            for path, inode, f in mappings(pid):
                if is_batch_memory(path):
                    held[inode] = max(held.get(inode, 0), f.get("Rss", 0))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if is_batch_memory(os.readlink(f"/proc/{pid}/fd/{fd}")):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        held[st.st_ino] = max(held.get(st.st_ino, 0), st.st_blocks * 512)
                except OSError:  # closed meanwhile
                    pass
        except OSError:  # the process gone meanwhile
            pass
    return sum(held.values()) / 1e6


def private_file_mb(pid: int) -> float:
    """`pid`'s private pages of mapped files (shared libraries above all): private only while
    no other process on the machine maps them, so they move with what else runs."""
    return sum(f.get("Private_Clean", 0) + f.get("Private_Dirty", 0) for path, _, f in mappings(pid)
               if path.startswith("/") and not is_batch_memory(path)) / 1e6


def anonymous_rss_mb(pid: int) -> float:
    """`pid`'s resident anonymous memory (heap, arenas, stacks), private or shared with its
    forked children: unlike USS, a fork sharing its pages copy-on-write does not move it."""
    return sum(f.get("Rss", 0) for path, _, f in mappings(pid) if not path.startswith("/")) / 1e6


def consume(sink, batch) -> None:
    """What a training step does with a batch's images: read every byte (here into `sink`)."""
    images = batch[0]
    sink[:len(images)].copy_(images)


def one(packed: str, kind: str, workers: int, batch: int, batches: int, steps: int = 15) -> dict:
    """One run of `kind`, in this (fresh) process."""
    import psutil
    import torch

    from readers import LMDBDataset, RandomResizedCrop, make_loader

    me = psutil.Process()
    alone = statistics.median(fixed_step() for _ in range(steps))
    data = LMDBDataset(packed, decode="raw", transform=RandomResizedCrop(224, flip=0.5))
    trainer_pss, trainer_uss, trainer_file = uss_mb([me], "pss"), uss_mb([me]), private_file_mb(me.pid)
    trainer_anon = anonymous_rss_mb(me.pid)
    start = time.perf_counter()
    loader = make_loader(data, batch, workers=workers, worker_kind=kind)
    it = iter(loader)
    taken = next(it)
    first = time.perf_counter() - start
    # Made after the loader's processes fork: a tensor the trainer writes after the fork
    # would leave its stale copy private to each of them (as a trainer's CPU-side
    # weights would, in every kind alike).
    sink = torch.empty_like(taken[0])
    consume(sink, taken)
    procs = loader_processes(me)
    cpu0, t0 = cpu_seconds([me, *procs]), time.perf_counter()
    samples = 0
    for _ in range(batches):
        taken = next(it)
        consume(sink, taken)
        samples += len(taken[0])
    wall = time.perf_counter() - t0
    procs = loader_processes(me)
    cpu = cpu_seconds([me, *procs]) - cpu0
    each = [uss_mb([p]) for p in procs]
    figures = {"uss_mb": uss_mb([me, *procs]), "loader_uss_mb": sum(each),
               "trainer_added_uss_mb": uss_mb([me]) - trainer_uss,
               "trainer_added_anon_mb": anonymous_rss_mb(me.pid) - trainer_anon,
               "trainer_added_file_mb": private_file_mb(me.pid) - trainer_file,
               "loader_mb": uss_mb([me, *procs], "pss") - trainer_pss, "uss_mb_each": each,
               "batch_shm_mb": batch_shm_mb(me.pid), "batch_memory_mb": batch_memory_mb([me.pid, *(p.pid for p in procs)])}
    del taken
    beside = []
    for _ in range(steps):
        beside.append(fixed_step())
        consume(sink, next(it))
    del it
    return {"kind": kind, "first_batch_s": first, "samples_per_s": samples / wall, "cpu_s_per_sample": cpu / samples,
            **figures, "loader_processes": len(procs), "step_slowdown": statistics.median(beside) / alone}


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


def too_few_samples(packed: str, batch: int, batches: int) -> str | None:
    """Why the pack cannot give a run its first batch and --batches more in one pass (whole
    batches: make_loader drops the last short one), or None."""
    from readers import LMDBDataset

    have, need = len(LMDBDataset(packed, decode="raw")), (batches + 1) * batch
    if have >= need:
        return None
    return (f"{packed}: {have} samples, and a run takes {batches} + 1 batches of {batch} = {need} in one pass; "
            f"pass a smaller --batch or --batches, or a larger pack")


def run(packed: str, kind: str, args) -> dict:
    cmd = [sys.executable, __file__, packed, "--one", kind, "--workers", str(args.workers), "--batch",
           str(args.batch), "--batches", str(args.batches), "--steps", str(args.steps)]
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


def at_least_one(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1, got {value}")
    return count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("packed", help="an LMDB pack (the standard corpus: benchmarks/suites/corpus.py)")
    p.add_argument("--workers", type=int, default=2, help="processes, or threads: the cores given to loading")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=at_least_one, default=15, help="fixed steps timed alone and beside the loader, each")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--profile", help="write a cProfile of one thread worker here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.packed, args.one, args.workers, args.batch, args.batches, args.steps)))
        return 0
    short = too_few_samples(args.packed, args.batch, args.batches)
    if short:
        p.error(short)
    if args.profile:
        profile(args.packed, args.batch, args.batches, args.profile)
    kinds = args.kinds.split(",")
    rounds = {kind: [] for kind in kinds}
    for r in range(args.repeats):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            rounds[kind].append(run(args.packed, kind, args))
    keys = ("samples_per_s", "first_batch_s", "cpu_s_per_sample", "loader_uss_mb", "trainer_added_uss_mb",
            "trainer_added_anon_mb", "uss_mb",
            "loader_mb", "batch_shm_mb", "batch_memory_mb", "step_slowdown")
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
