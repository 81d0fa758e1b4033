"""Cold random reads of record-sized ranges by how many are in flight: the disk's own curve.

    python benchmarks/suites/disk_depth.py PACKED [--depths 1,2,4,8,16,32,64]
                                          [--seconds 1.5] [--repeats 3] [--json out.json]

A packed reader with hints keeps many reads in flight; a folder read through a
DataLoader keeps one per worker. How much more the disk gives at depth than at the
folder's few reads in flight bounds what any reader of the same bytes can gain over
the folder cold, on that disk: the plain-loader goal of 2x needs this curve to rise
at least 2x from depth = workers to depth 16-64.

Each run evicts the dataset's largest data file, then `depth` threads pread ranges of
the dataset's mean record size at random record-aligned slots, each slot read once
(no read is served from the cache), for `seconds`. Depths are interleaved within each
repeat (a shared disk drifts) and the median MB/s is reported. No file system walk, no
open per read: this is the device and the page cache alone.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cache  # noqa: E402
from benchmarks.suites import _study  # noqa: E402
from packer.formats import open_reader  # noqa: E402


def mean_record_bytes(packed: str, sample: int = 500) -> int:
    """The mean stored image size, from records spread over the dataset (at least 4 KiB)."""
    reader = open_reader(packed)
    try:
        step = max(1, len(reader) // sample)
        sizes = [len(reader.read_image(i)[0]) for i in range(0, len(reader), step)]
    finally:
        reader.close()
    return max(4096, int(statistics.fmean(sizes)) if sizes else 4096)


def depth_rate(path: str, depth: int, size: int, seconds: float, seed: int) -> float:
    """MB/s of `depth` threads reading distinct random `size`-byte slots of a cold file."""
    cache.evict([path])
    slots = list(range(os.path.getsize(path) // size))
    random.Random(seed).shuffle(slots)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the readers advise random access
        stop = time.perf_counter() + seconds

        def reader(first: int) -> int:
            done = 0
            for slot in slots[first::depth]:  # a thread started late still reads once: no run is empty
                done += len(os.pread(fd, size, slot * size))
                if time.perf_counter() >= stop:
                    break
            return done

        start = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            nbytes = sum(pool.map(reader, range(depth)))
        return nbytes / 1e6 / (time.perf_counter() - start)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = _study.parser(__doc__, repeats=3)
    parser.add_argument("--depths", default="1,2,4,8,16,32,64", help="reads in flight, comma-separated")
    parser.add_argument("--seconds", type=float, default=1.5, help="per run")
    args = _study.parse(parser, argv)
    depths = [int(x) for x in args.depths.split(",")]
    if not depths or min(depths) < 1:
        parser.error("--depths: positive numbers of reads in flight")
    path = max(cache.data_files(args.packed), key=os.path.getsize)
    size = mean_record_bytes(args.packed)
    runs: dict[int, list[float]] = {d: [] for d in depths}
    for r in range(args.repeats):
        for depth in depths:
            runs[depth].append(depth_rate(path, depth, size, args.seconds, seed=r))
    base = statistics.median(runs[depths[0]])
    print(f"cold random reads of {size:,}-byte ranges of {path}, median of {args.repeats}")
    print(f"| reads in flight | MB/s | x depth {depths[0]} | runs |\n|---:|---:|---:|---|")
    for depth, values in runs.items():
        rate = statistics.median(values)
        print(f"| {depth} | {rate:,.0f} | {rate / base:.2f} | {', '.join(f'{v:,.0f}' for v in values)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"packed": args.packed, "file": path, "record_bytes": size,
                                               "runs": {str(d): v for d, v in runs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
