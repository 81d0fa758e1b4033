"""Where the time to a pass's first batch goes, per worker kind: a timeline of wall-clock marks.

    python benchmarks/suites/first_batch.py PACKED_LMDB [--workers 2] [--batch 64] [--repeats 5]

Each run is a fresh process, as in thread_workers.py (decode="raw" + RandomResizedCrop(224),
the kinds interleaved round by round); the marks, in ms from make_loader(), medians:
- start: the first loader process begins its work (the thread workers' serve(), a
  DataLoader worker's loop);
- first sample: the first worker (process or thread) begins reading its first sample;
- sample 0 done: that first sample read, decoded and cropped (the first call of each step);
- first batch: the trainer holds the pass's first batch.
What the first batch costs past its first sample is decode: W processes each make a whole
batch, W threads split one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MARKS = ("start", "first sample", "sample 0 done", "first batch")


def one(packed: str, kind: str, workers: int, batch: int) -> dict:
    """The marks of one run of `kind`, in this (fresh) process: each process appends its
    own to a file (forked processes inherit the wrapped functions)."""
    import torch.utils.data._utils.worker as worker_module

    import readers._dataset as dataset_module
    import readers.threads as threads
    from readers import LMDBDataset, RandomResizedCrop, make_loader

    log = Path(f"/tmp/first-batch-{os.getpid()}.log")
    start = time.time()

    def mark(what: str) -> None:
        with open(log, "a") as out:
            out.write(f"{what}\t{time.time() - start}\n")

    serve, loop = threads.serve, worker_module._worker_loop
    getitem, seen = dataset_module.ReaderDataset.__getitem__, set()

    def marked_serve(*args, **kwargs):
        mark("start")
        return serve(*args, **kwargs)

    def marked_loop(*args, **kwargs):
        mark("start")
        return loop(*args, **kwargs)

    def marked_getitem(self, index):
        first = (os.getpid(), threading.get_ident()) not in seen
        if not first:
            return getitem(self, index)
        seen.add((os.getpid(), threading.get_ident()))
        mark("first sample")
        sample = getitem(self, index)
        mark("sample 0 done")
        return sample

    threads.serve, worker_module._worker_loop = marked_serve, marked_loop
    dataset_module.ReaderDataset.__getitem__ = marked_getitem
    data = LMDBDataset(packed, decode="raw", transform=RandomResizedCrop(224, flip=0.5))
    start = time.time()
    loader = make_loader(data, batch, workers=workers, worker_kind=kind)
    batches = iter(loader)
    next(batches)
    mark("first batch")  # before the loader and its workers are closed
    marks = {}
    for line in log.read_text().splitlines():
        what, at = line.split("\t")
        marks.setdefault(what, float(at) * 1e3)  # the earliest of each
    log.unlink()
    del batches, loader
    return {"kind": kind, **{m: marks.get(m) for m in MARKS}}


def median_ms(marks: list) -> str:
    """The median of the runs that made the mark; "–" where none did (threads-inline starts
    no loader process)."""
    made = [m for m in marks if m is not None]
    return f"{statistics.median(made):.0f}" if made else "–"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("packed")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default="processes,threads")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.packed, args.one, args.workers, args.batch)))
        return 0
    kinds, rounds = args.kinds.split(","), {}
    for r in range(args.repeats):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            cmd = [sys.executable, __file__, args.packed, "--one", kind, "--workers", str(args.workers),
                   "--batch", str(args.batch)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            rounds.setdefault(kind, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.workers} workers, batches of {args.batch}, ms from make_loader (medians of {args.repeats}); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"| kind | {' | '.join(MARKS)} |\n|---|{'---:|' * len(MARKS)}")
    for kind, runs in rounds.items():
        print(f"| {kind} | " + " | ".join(median_ms([r[m] for r in runs]) for m in MARKS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
