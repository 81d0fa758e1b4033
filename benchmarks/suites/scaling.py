"""Worker scaling: make_loader's end-to-end rate by workers, against workers x one process's
decode + crop rate, and against as many lone processes decoding at once.

    python benchmarks/suites/scaling.py FOLDER PACK.lmdb [--workers 1,2,4,8,16] [--device cuda]
                                        [--quick] [--seconds S] [--workdir DIR] [--json out.json]

The suite's own cases, each in a fresh process (benchmarks.run.run_children): the per-core
rate is the `augment` measure (read + decode + RandomResizedCrop(224) + flip, one process,
warm) and `ceiling`; each row is `e2e` warm with no step (make_loader(LMDB) to the device)
at that many workers (capped at the cores), timed long, since the e2e window opens with
each worker's prefetched batches already queued, which a short run would count as speed.
Beside each row, the parallel baseline: as many spawned processes, each decoding and
cropping the LMDB's records alone, all timed over the same window: what the cores give
together (turbo, shared caches, SMT) with no loader in the way. The goal: a fraction of
0.9 at 16 workers.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import readers  # noqa: E402
from benchmarks.measures import Options  # noqa: E402
from benchmarks.run import run_children  # noqa: E402

WORKERS = (1, 2, 4, 8, 16)
GOAL = "fraction >= 0.9 at 16 workers"


def nothing(message: str) -> None:
    """The default `note`: a caller that saves results as they come passes its own."""


def measure(entry: dict, folder: str, lmdb: str, device: str, workdir: str, workers=WORKERS, quick: bool = False,
            seed: int = 0, seconds_left=lambda: float("inf"), note=nothing, seconds: float | None = None) -> None:
    """Fills entry with the config, the per-core rate and a row per worker count, calling
    note(message) after each row; stops before a row that seconds_left() cannot hold.
    seconds, where given, times every case and parallel baseline that long (a plumbing check)."""
    cores = os.cpu_count() or 1
    counts = sorted({min(w, cores) for w in workers})
    budget, repeat = (1.0, 1) if quick else (5.0, 2)
    budget = seconds or budget
    ctx = {"folder": folder, "packed": {"lmdb": lmdb}}
    base = dict(budget=budget, warmup=min(0.5, budget), repeat=repeat, batch_size=64, device=device, step_ms=0.0,
                seed=seed)
    entry["config"] = {**base, "workers": counts, "source": "lmdb", "cache": "warm",
                       "what": "e2e warm, no step: make_loader(LMDB) to the device; per-core rate: the "
                               "augment measure (read + decode + RandomResizedCrop(224) + flip, one process)"}
    os.makedirs(workdir, exist_ok=True)
    per_core = run_children([[{"source": "lmdb", "measure": "augment", "cache": "warm"}],
                             [{"source": None, "measure": "ceiling", "cache": None}]],
                            ctx, Options(workers=1, **base), workdir)
    entry["per_core"], entry["ceiling"] = per_core
    rate = per_core[0].get("median")
    if not rate:
        raise RuntimeError(f"the per-core decode+crop rate failed: {per_core[0].get('error')}")
    rows = entry.setdefault("rows", [])
    for w in counts:
        if seconds_left() < 10 + 2 * budget * repeat:
            entry["note"] = f"stopped before {w} workers: the time budget"
            break
        (case,) = run_children([[{"source": "lmdb", "measure": "e2e", "cache": "warm"}]], ctx,
                               Options(workers=w, **base), workdir)
        rows.append(row(entry, lmdb, w, rate, case, seconds))
        note(f"scaling {w} workers: {json.dumps(rows[-1])}")
    entry["goal"] = GOAL


def row(entry: dict, lmdb: str, workers: int, rate: float, case: dict, seconds: float | None = None) -> dict:
    """One worker count's figures; a failing parallel baseline is noted in entry, the row kept."""
    got = case.get("median")
    try:
        parallel = parallel_rate(lmdb, workers, **({} if seconds is None else {"seconds": seconds}))
    except Exception as exc:  # the baseline failing leaves the loader's row standing
        parallel, entry["parallel_error"] = None, f"{type(exc).__name__}: {exc}"
    return {"workers": workers, "samples_per_s": got, "fraction": got / (workers * rate) if got else None,
            "parallel_samples_per_s": parallel,
            "parallel_fraction": parallel / (workers * rate) if parallel else None,
            "fraction_of_parallel": got / parallel if got and parallel else None,
            "wait_fraction": (case.get("wait_fraction") or {}).get("median"),
            "status": case["status"], "error": case.get("error")}


def decode_for(lmdb: str, start_at: float, seconds: float, seed: int) -> float:
    """One process of the parallel baseline: read + decode + RandomResizedCrop(224) + flip of
    LMDB records in a random order, busy until start_at (so every process runs when the
    timing opens), then counted for `seconds`. Returns its images/s."""
    torch.set_num_threads(1)  # as in a loader worker
    torch.manual_seed(seed)
    dataset = readers.LMDBDataset(lmdb, decode="raw", transform=readers.RandomResizedCrop(224, flip=0.5))
    order = np.random.default_rng(seed).permutation(len(dataset))
    # A process started after the window opened (a loaded machine) times a whole window of its
    # own, rather than what is left of the others' (nothing, when it came after their end).
    end = max(start_at, time.time()) + seconds
    i = n = 0
    while time.time() < start_at:
        dataset[int(order[i % len(order)])]
        i += 1
    t0 = time.time()
    while True:  # at least one image, however long the process waits for a core
        dataset[int(order[(i + n) % len(order)])]
        n += 1
        if (t := time.time()) >= end:
            break
    dataset.close()
    return n / (t - t0)


def parallel_rate(lmdb: str, processes: int, seconds: float = 4.0, lead: float = 4.0) -> float:
    """images/s of `processes` independent decode+crop processes at once: what the machine's
    cores give together (turbo, shared caches, SMT), with no loader in the way."""
    start_at = time.time() + lead  # spawn and imports take a second or two
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        rates = pool.starmap(decode_for, [(lmdb, start_at, seconds, seed) for seed in range(processes)])
    return sum(rates)


def table(entry: dict) -> str:
    """The rows as Markdown, a column per worker count."""
    rows = entry.get("rows", [])
    per_core = entry["per_core"].get("median") or 0

    def cells(key, fmt, missing="–"):
        return " | ".join(missing if r.get(key) is None else format(r[key], fmt) for r in rows)

    lines = ["| | " + " | ".join(f"{r['workers']} workers" for r in rows) + " |", "|---|" + "---:|" * len(rows),
             f"| e2e warm, samples/s | {cells('samples_per_s', ',.0f', 'error')} |",
             f"| ÷ (workers × per-core {per_core:,.0f}/s) | {cells('fraction', '.2f')} |",
             f"| as many lone decode+crop processes at once, images/s | {cells('parallel_samples_per_s', ',.0f')} |",
             f"| their ÷ (workers × per-core) | {cells('parallel_fraction', '.2f')} |",
             f"| e2e ÷ the lone processes at once | {cells('fraction_of_parallel', '.2f')} |"]
    return "\n".join(lines)


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"--seconds must be above 0, got {value}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("folder", help="the ImageFolder tree the LMDB was packed from (the ceiling case reads it)")
    p.add_argument("lmdb", help="a packer LMDB of JPEGs")
    p.add_argument("--workers", type=lambda v: [int(w) for w in v.split(",")], default=list(WORKERS),
                   help="worker counts, comma-separated (default: 1,2,4,8,16, capped at the cores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="1 s runs, once: a check of the plumbing")
    p.add_argument("--seconds", type=positive_seconds,
                   help="time each case and parallel baseline this long (default: 5, or 1 with --quick; baseline 4)")
    p.add_argument("--workdir", default="scaling-work", help="the cases' scratch files (default: scaling-work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    entry: dict = {}
    measure(entry, args.folder, args.lmdb, args.device, args.workdir, args.workers, args.quick, args.seed,
            note=lambda message: print(message, file=sys.stderr), seconds=args.seconds)
    print(table(entry))
    if args.json:
        Path(args.json).write_text(json.dumps(entry, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
