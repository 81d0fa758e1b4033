"""Warm random reads of a pack's records by pread (what the readers do) and through a mapping.

    python benchmarks/suites/map_reads.py PACKED [--records 20000] [--repeats 5] [--json out.json]

The readers read a record with one pread into new bytes, then hash those bytes if the
check is on. A record can also be read from a read-only mapping of the file: hashed
where it lies in the page cache, then copied into new bytes from the CPU cache. This
study times both, warm (every data file is read into the page cache first), over the
same random records (their extents from the reader, Reader.record_extents), in
microseconds per record. The files are first evicted and filled as --fill says: read
front to back (the default), or by one cold epoch in random or block order, as a
training run's first epoch fills them; how the pages entered the cache moves a pread's
cost by up to 70% (warm_state.py).

  pread               os.pread into new bytes (the readers' unchecked read, bare)
  pread + xxh3        the same, then XXH3-64 of the bytes (the readers' checked read, bare)
  map                 bytes() of a view of a mapping that has already been read once
  map + xxh3          XXH3-64 of that view, then bytes() of it
  map + xxh3, fresh   the same on a new mapping: every page faulted into it on first
                      touch, as in each DataLoader worker's first pass over the data

Rounds interleave the cases (a shared machine drifts); the median is reported. Only
files local to this machine; no reader is changed by it.
"""
from __future__ import annotations

import json
import mmap
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from xxhash import xxh3_64_intdigest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.suites import _study, warm_state  # noqa: E402
from packer.formats import open_reader  # noqa: E402

CASES = ("pread", "pread + xxh3", "map", "map + xxh3", "map + xxh3, fresh")


def extents(packed: str, records: int, seed: int) -> tuple[list, list]:
    """(paths of the files, [(file number, offset, length)]) of `records` random records."""
    reader = open_reader(packed)
    try:
        chosen = np.random.default_rng(seed).permutation(len(reader))[:records]
        found = list(reader.record_extents(chosen))
        paths = sorted({os.path.realpath(f"/proc/self/fd/{fd}") for fd, _, _ in found})
        number = {path: k for k, path in enumerate(paths)}
        return paths, [(number[os.path.realpath(f"/proc/self/fd/{fd}")], at, n) for fd, at, n in found]
    finally:
        reader.close()


def timed(read, spans: list) -> float:
    start = time.perf_counter()
    for span in spans:
        read(*span)
    return (time.perf_counter() - start) / len(spans) * 1e6


def one_round(paths: list, spans: list, seed: int) -> dict:
    """Microseconds per record of each case, over spans in a new random order."""
    spans = spans[:]
    random.Random(seed).shuffle(spans)
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    mapped = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]
    views = [memoryview(m) for m in mapped]
    try:
        timed(lambda f, at, n: bytes(views[f][at:at + n]), spans)  # every page of the spans mapped once
        out = {
            "pread": timed(lambda f, at, n: os.pread(fds[f], n, at), spans),
            "pread + xxh3": timed(lambda f, at, n: xxh3_64_intdigest(os.pread(fds[f], n, at)), spans),
            "map": timed(lambda f, at, n: bytes(views[f][at:at + n]), spans),
            "map + xxh3": timed(lambda f, at, n: (xxh3_64_intdigest(views[f][at:at + n]),
                                                  bytes(views[f][at:at + n])), spans),
        }
        fresh = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]
        mapped += fresh
        views += [memoryview(m) for m in fresh]
        first = len(fds)
        out["map + xxh3, fresh"] = timed(lambda f, at, n: (xxh3_64_intdigest(views[first + f][at:at + n]),
                                                           bytes(views[first + f][at:at + n])), spans)
        return out
    finally:
        for view in views:
            view.release()
        for m in mapped:
            m.close()
        for fd in fds:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = _study.parser(__doc__, repeats=5)
    parser.add_argument("--records", type=int, default=20000, help="random records read per case and round")
    parser.add_argument("--fill", choices=warm_state.FILLS, default="read-through",
                        help="how the page cache is filled first (warm_state.py's fills; a training run's "
                             "first epoch fills it as random-epoch does)")
    args = _study.parse(parser, argv)
    paths, spans = extents(args.packed, args.records, seed=0)
    if not spans:
        parser.error(f"{args.packed}: no record lies in one run of a local file")
    warm_state.fill(args.packed, args.fill, seed=0)  # how pages entered the cache moves a pread's cost
    runs: dict[str, list[float]] = {case: [] for case in CASES}
    for r in range(args.repeats):
        for case, value in one_round(paths, spans, seed=r).items():
            runs[case].append(value)
    size = statistics.fmean(n for _, _, n in spans)
    print(f"warm random reads of {len(spans):,} records ({size:,.0f} bytes on average) of {args.packed}, "
          f"cache filled by {args.fill}, median of {args.repeats}")
    print("| read | µs per record | runs |\n|---|---:|---|")
    for case, values in runs.items():
        print(f"| {case} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"packed": args.packed, "fill": args.fill, "records": len(spans),
                                               "mean_bytes": size, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
