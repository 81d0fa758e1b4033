"""The GIL held while a worker's batch is freed after pinning, with its shared memory given back first and without.

    python benchmarks/suites/pin_handover.py [--batch 256] [--size 224] [--workers 2] [--alone | --pin]
                                             [--batches 40] [--repeats 5] [--json out.json]

With a CUDA target, DataLoader's pin thread copies each batch from the worker's shared
memory to pinned memory and drops it; the pages are freed by that drop's munmap, under
the GIL, so the training thread cannot run Python (launch its kernels) meanwhile.
make_loader's workers send their batches as readers.buffers.WorkerBatch, whose pinning
gives those pages back first, with the GIL released (give_back).

No GPU is needed to see it: uint8 3 x size x size images made in memory (no decode) go
through make_loader's own collate in W workers; a thread stands in for the pin thread,
taking each batch from the DataLoader and copying it into ordinary memory (pinned memory
needs CUDA), then dropping it, as torch's pin thread does; the main thread stands in for
the training loop, a Python loop that wakes every 0.2 ms and records how long each wait
really took. Reported, for each way, with rounds interleaved (medians over rounds): the
training thread's longest stall per batch (median and 90th percentile over batches), its
stalled time (waits past 1 ms) per batch, and the handover thread's time per batch.
On few cores the workers and the handover thread also keep the training thread from a
core; --alone makes every batch in shared memory before the run (no workers), which
leaves the GIL as the only thing the training thread waits for. --pin (CUDA) is the
real thing: DataLoader(pin_memory=True), torch's own pin thread pinning and dropping each
batch, the thread between it and the training loop only passing batches on.
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from readers.buffers import WorkerBatch, pinned_then_given_back  # noqa: E402
from readers.gpu import map_tensors  # noqa: E402
from readers.loader import batch_collate  # noqa: E402

WAYS = ("freed by the drop", "given back first")
TICK_S = 0.0002
STALL_S = 0.001


class Images(torch.utils.data.Dataset):
    """n (uint8 image, label) samples, each a copy of one random image (no decode)."""

    def __init__(self, n: int, size: int):
        self.n, self.image = n, torch.randint(0, 256, (3, size, size), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.image.clone(), i % 1000


def copied(batch):
    """The batch copied into new ordinary memory: pinning's copy, without CUDA (clone: an
    in-place copy_ into new memory held the GIL ~3.5 ms per 38.5 MB here, clone 0.7)."""
    return map_tensors(batch, torch.clone)


def made_alone(dataset: Images, batch: int, give_back: bool):
    """The loader's batches, each in its own shared memory as a worker makes them, all made
    before the first is handed over (so the handover thread only copies and drops)."""
    made = []
    for first in range(0, len(dataset), batch):
        images = torch.stack([dataset[i][0] for i in range(first, first + batch)]).share_memory_()
        labels = torch.arange(first, first + batch).share_memory_()
        made.append(WorkerBatch((images, labels)) if give_back else (images, labels))
    made.reverse()
    while made:
        yield made.pop()  # the last reference goes with the handover thread's drop


def hand_over(loader, out: queue.Queue, seconds: list, pinned: bool = False) -> None:
    """The pin thread's part: take, copy, drop; each batch's time in seconds. pinned: the
    loader's pin thread has done it all, so pass the batches on."""
    for batch in loader:
        start = time.perf_counter()
        if isinstance(batch, WorkerBatch):
            batch = pinned_then_given_back(batch.batch, copied)
        elif not pinned:
            batch = copied(batch)
        seconds.append(time.perf_counter() - start)  # the drop of the old batch is inside
        out.put(batch)
    out.put(None)


def run(give_back: bool, args) -> dict:
    """One run: the training thread's stalls while `batches` batches are handed over."""
    dataset = Images(args.batches * args.batch, args.size)
    if args.alone:
        loader = made_alone(dataset, args.batch, give_back)
    else:
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=args.batch, num_workers=args.workers, pin_memory=args.pin,
            collate_fn=batch_collate(None, False, None, give_back=give_back), prefetch_factor=2)
    out: queue.Queue = queue.Queue(maxsize=2)
    handover_s: list[float] = []
    thread = threading.Thread(target=hand_over, args=(loader, out, handover_s, args.pin), daemon=True)
    longest, stalled = [], []
    thread.start()
    first = out.get()  # workers started: measure from the first batch on
    del first
    while True:
        worst = waited = 0.0
        last = time.perf_counter()
        while True:  # the training loop: wake every tick until the next batch is there
            try:
                batch = out.get_nowait()
                break
            except queue.Empty:
                time.sleep(TICK_S)
                now = time.perf_counter()
                gap = now - last - TICK_S
                worst = max(worst, gap)
                waited += gap if gap > STALL_S else 0.0
                last = now
        if batch is None:
            break
        longest.append(worst)
        stalled.append(waited)
        del batch
    thread.join()
    return {"longest_ms_median": statistics.median(longest) * 1e3,
            "longest_ms_p90": statistics.quantiles(longest, n=10)[-1] * 1e3,
            "stalled_ms_per_batch": statistics.fmean(stalled) * 1e3,
            "handover_ms_per_batch": statistics.median(handover_s[1:]) * 1e3,
            "batches": len(longest)}


def main(argv=None) -> int:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=2)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--alone", action="store_true", help="no workers: every batch made before the run")
    how.add_argument("--pin", action="store_true", help="torch's pin thread, pinning for real (CUDA)")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    if args.batches < 3:
        p.error("--batches must be at least 3")
    if args.pin and not torch.cuda.is_available():
        p.error("--pin needs CUDA (pinned memory is CUDA's)")
    rounds = {way: [] for way in WAYS}
    for r in range(args.repeats):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            rounds[way].append(run(way == WAYS[1], args))
    mb = 3 * args.size * args.size * args.batch / 1e6
    made = "made before the run" if args.alone else f"{args.workers} workers"
    made += ", torch's pin thread pinning" if args.pin else ", copied by a stand-in for the pin thread"
    print(f"{args.batch} images of 3x{args.size}x{args.size} uint8 a batch ({mb:.1f} MB), {made}, "
          f"{args.batches} batches a run, {args.repeats} rounds (medians)")
    keys = ("longest_ms_median", "longest_ms_p90", "stalled_ms_per_batch", "handover_ms_per_batch")
    print(f"{'':22}" + "".join(f"{k:>24}" for k in keys))
    summary = {}
    for way, runs in rounds.items():
        summary[way] = {k: statistics.median(run[k] for run in runs) for k in keys}
        print(f"{way:22}" + "".join(f"{summary[way][k]:24.2f}" for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "summary": summary, "runs": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
