"""Cold random reads of a packed dataset through ShuffleSampler, at several read-ahead depths.

    python benchmarks/suites/read_ahead.py PACKED [--ahead 0,16,64,256] [--records 6000]
                                          [--repeats 3] [--json out.json]

For each depth the dataset's data files are evicted from the page cache, then `records`
records are read with ds[i] (raw bytes, no CRC check) in readers.ShuffleSampler order
with that many records hinted ahead; depth 0 sends no hints (prefetch=False), which is
what any sampler that does not hint gets. Depths are interleaved within each repeat (a
shared machine drifts) and the median records/s is reported. Needs posix_fadvise to
evict (Linux); the CUDA-free single process measures reading alone.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import readers  # noqa: E402
from benchmarks import cache  # noqa: E402
from benchmarks.suites import _study  # noqa: E402


def cold_rate(path: str, ahead: int, records: int, seed: int) -> float:
    """Records/s reading `records` records of a freshly evicted dataset, `ahead` hinted."""
    files = cache.data_files(path)
    dataset = readers.open_dataset(path, decode="raw", check_crc=False)
    dataset.reader.advise("random")
    cache.evict(files)
    dataset.open()  # tables only: opening reads no record
    order = readers.ShuffleSampler(dataset, seed=seed, prefetch=ahead > 0, ahead=ahead)
    n = 0
    start = time.perf_counter()
    for i in order:
        dataset[i]
        n += 1
        if n == records:
            break
    seconds = time.perf_counter() - start
    dataset.close()
    return n / seconds


def main(argv: list[str] | None = None) -> int:
    parser = _study.parser(__doc__, repeats=3)
    parser.add_argument("--ahead", default="0,16,64,256", help="depths, comma-separated (0: no hints)")
    parser.add_argument("--records", type=int, default=6000, help="records read per run")
    args = _study.parse(parser, argv)
    depths = [int(x) for x in args.ahead.split(",")]
    runs: dict[int, list[float]] = {d: [] for d in depths}
    for r in range(args.repeats):
        for depth in depths:
            runs[depth].append(cold_rate(args.packed, depth, args.records, seed=r))
    print(f"cold random reads, {args.records} records of {args.packed}, median of {args.repeats}")
    print("| records hinted ahead | records/s | runs |\n|---:|---:|---|")
    for depth, values in runs.items():
        print(f"| {depth} | {statistics.median(values):,.0f} | {', '.join(f'{v:,.0f}' for v in values)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"packed": args.packed, "records": args.records,
                                               "runs": {str(d): v for d, v in runs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
