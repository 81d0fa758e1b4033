"""What keyed augmentation (readers.keyed) costs make_loader: one pass of decode + RandomResizedCrop(224, flip=0.5).

    python benchmarks/suites/keyed_cost.py PACKED --keyed on|off [--records 2000] [--batch 64]
                                           [--workers 0] [--seed 0]

One process, one setting, so that a whole-process timer can pair the two settings run by
run (A B A B ...): make_loader(train=True, keyed=...) over PACKED read raw and transformed
in the workers (or, with --workers 0, in this process, where the cost is not hidden by
idle cores); the first --records samples of epoch 0, then the samples/s of the pass after
its first batch, printed. The page cache is warmed first (every file read once).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import readers  # noqa: E402
from benchmarks import cache  # noqa: E402


def samples_per_second(packed: str, keyed: bool, records: int, batch: int, workers: int, seed: int) -> float:
    dataset = readers.open_dataset(packed, decode="raw", transform=readers.RandomResizedCrop(224, flip=0.5))
    loader = readers.make_loader(dataset, batch, workers=workers, seed=seed, keyed=keyed)
    batches = iter(loader)
    next(batches)  # workers started, handles open
    samples, start = 0, time.perf_counter()
    for images, _ in batches:
        samples += len(images)
        if samples >= records:
            break
    rate = samples / (time.perf_counter() - start)
    del batches
    return rate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packed", help="a packer LMDB, HDF5 or wds dataset")
    p.add_argument("--keyed", choices=("on", "off"), required=True)
    p.add_argument("--records", type=int, default=2000, help="samples timed")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cache.prepare(cache.data_files(args.packed), "warm")
    rate = samples_per_second(args.packed, args.keyed == "on", args.records, args.batch, args.workers, args.seed)
    print(f"keyed={args.keyed} workers={args.workers} batch={args.batch}: {rate:,.1f} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
