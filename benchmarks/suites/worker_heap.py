"""DataLoader workers with their heap kept between batches (readers.heap) against glibc's defaults.

    python benchmarks/suites/worker_heap.py PACKED [--folder SRC] [--batch 64 256] [--workers 2]
                                            [--cache warm|cold] [--crop] [--records 15000] [--repeats 5]
                                            [--json out.json]

Raw bytes (decode="raw", the default checksum check on) through a plain
DataLoader(shuffle=True, num_workers=W, batch_size=B), the README's drop-in, whose
collate counts bytes in the worker, warm (the files read into the page cache first) or
cold (the source's files evicted before each run): samples/s with PACKER_KEEP_HEAP=0
(glibc's defaults: freed memory goes back to the kernel and comes back page by page)
and with the heap kept (the default), each run with fresh
workers, for each batch size, the cases interleaved round by round (medians). Each run
also gives its workers' minor page faults per sample, read in the workers: the cost the
kept heap removes. --folder adds the same rows for FolderDataset, which keeps its heap
the same way. --crop decodes and crops each image in the worker instead
(readers.RandomResizedCrop(224, flip=0.5), batches stacked by readers.collate): the
e2e path's work, whose decode dwarfs the faults.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import readers  # noqa: E402
from benchmarks import cache  # noqa: E402
from benchmarks.measures import count_bytes  # noqa: E402
from readers import FolderDataset, RandomResizedCrop, collate, heap  # noqa: E402

SETTINGS = {"glibc defaults": "0", "heap kept": "1"}


def count_in_worker(batch: list) -> tuple[int, int, int]:
    """(samples, bytes, this worker's minor faults so far): the suite's loader collate
    (benchmarks.measures.count_bytes), run in the worker, and the faults."""
    return (*count_bytes(batch), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def crop_in_worker(batch: list) -> tuple[int, int, int]:
    """As count_in_worker, for decoded crops: stacked as make_loader's workers stack them."""
    images, _ = collate(batch)
    return len(batch), images.numel(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(dataset, batch: int, workers: int, records: int, keep: str) -> tuple[float, float]:
    """(samples/s, workers' minor faults per sample) of one pass of at most `records`
    samples after each worker's first batch, with PACKER_KEEP_HEAP=keep in fresh workers."""
    os.environ[heap.ENV] = keep  # the workers forked by iter() read it
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                         collate_fn=count_in_worker if dataset.transform is None else crop_in_worker,
                                         prefetch_factor=4)
    it = iter(loader)
    first = [next(it) for _ in range(workers)]  # workers forked, each past its first batch
    last_faults = [faults for _, _, faults in first]  # batches come from workers in turn
    samples, faults, start = 0, 0, time.perf_counter()
    for k, (n, _, worker_faults) in enumerate(it):
        samples += n
        faults += worker_faults - last_faults[k % workers]
        last_faults[k % workers] = worker_faults
        if samples >= records:
            break
    rate = samples / (time.perf_counter() - start)
    del it
    return rate, faults / max(samples, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packed", help="a packer LMDB, HDF5 or wds dataset")
    p.add_argument("--folder", help="also read this ImageFolder tree (FolderDataset)")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cache", choices=("warm", "cold"), default="warm")
    p.add_argument("--crop", action="store_true", help="decode and crop each image in the worker")
    p.add_argument("--records", type=int, default=15000, help="samples timed per run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the runs here")
    args = p.parse_args(argv)
    if heap.glibc() is None:
        p.error("readers.heap sets glibc's malloc thresholds; this C library is not glibc")
    if args.cache == "cold" and not cache.CAN_EVICT:
        p.error("cold runs evict the page cache with posix_fadvise (Linux)")
    transform = RandomResizedCrop(224, flip=0.5) if args.crop else None
    sources = {Path(args.packed).name: readers.open_dataset(args.packed, decode="raw", transform=transform)}
    files = {Path(args.packed).name: cache.data_files(args.packed)}
    if args.folder:
        sources["folder"] = FolderDataset(args.folder, decode="raw", transform=transform)
        files["folder"] = cache.data_files(args.folder)
    cases = [(source, batch, setting) for source in sources for batch in args.batch for setting in SETTINGS]
    if args.cache == "warm":
        for paths in files.values():
            cache.prepare(paths, "warm")
    runs: dict[tuple, list] = {case: [] for case in cases}
    saved = os.environ.get(heap.ENV)
    try:
        for round_ in range(args.repeats):
            for case in cases:
                source, batch, setting = case
                if args.cache == "cold":
                    cache.prepare(files[source], "cold")
                runs[case].append(run(sources[source], batch, args.workers, args.records, SETTINGS[setting]))
            print(f"round {round_ + 1}/{args.repeats}", file=sys.stderr)
    finally:
        if saved is None:
            os.environ.pop(heap.ENV, None)
        else:
            os.environ[heap.ENV] = saved
    rows = []
    for source in sources:
        for batch in args.batch:
            row = {"source": source, "batch": batch}
            for setting in SETTINGS:
                got = runs[(source, batch, setting)]
                row[setting] = {"samples/s": statistics.median(r for r, _ in got),
                                "faults/sample": statistics.median(f for _, f in got),
                                "runs": [r for r, _ in got]}
            row["kept / defaults"] = statistics.median(
                kept / default for (kept, _), (default, _) in zip(runs[(source, batch, "heap kept")],
                                                                   runs[(source, batch, "glibc defaults")]))
            rows.append(row)
    print(f"{'source':>16} {'batch':>5} {'defaults/s':>11} {'faults':>7} {'kept/s':>9} {'faults':>7} "
          f"{'kept/defaults':>13}")
    for row in rows:
        d, k = row["glibc defaults"], row["heap kept"]
        print(f"{row['source']:>16} {row['batch']:>5} {d['samples/s']:>11,.0f} {d['faults/sample']:>7.1f} "
              f"{k['samples/s']:>9,.0f} {k['faults/sample']:>7.1f} {row['kept / defaults']:>13.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"workers": args.workers, "cache": args.cache, "crop": args.crop,
                                               "records": args.records,
                                               "repeats": args.repeats, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
