"""Warm random reads of a packed dataset, by the way its page cache was filled.

    python benchmarks/suites/warm_state.py PACKED [--fills read-through,random-epoch,block-epoch]
                                          [--seconds 3] [--repeats 2] [--json out.json]

For each fill the dataset's data files are evicted, then read into the page cache:
`read-through` front to back (as the suite's warm rows are prepared), `random-epoch` one
cold epoch of ds[i] in readers.ShuffleSampler order (as a training run's first epoch fills
it), `block-epoch` one cold epoch in readers.BlockShuffleSampler order. Then, all data
cached, two rates are timed for `seconds` each: ds[i] (raw bytes, no CRC check) in
ShuffleSampler order, epoch after epoch, and the bare-read floor (measures.BareRead:
os.pread of each record's bytes, no reader code), so a slower state shows whether the
reader or the page cache is the cause. Where /proc/kpageflags can be read (root), the
share of cached pages held in large folios is reported too: the page cache's unit of
memory, which a front-to-back read makes large and random reads leave at single pages.
Fills are interleaved within each repeat (a shared machine drifts). Needs posix_fadvise
to evict (Linux).
"""
from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import readers  # noqa: E402
from benchmarks import cache  # noqa: E402
from benchmarks.measures import BareRead  # noqa: E402
from benchmarks.suites import _study  # noqa: E402

FILLS = ("read-through", "random-epoch", "block-epoch")
KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL = 15, 16  # /proc/kpageflags bits: page belongs to a large folio
PFN_MASK = (1 << 55) - 1  # /proc/self/pagemap: bits 0-54 are the page frame number


def open_raw(path: str):
    dataset = readers.open_dataset(path, decode="raw", check_crc=False)
    dataset.reader.advise("random")
    return dataset


def fill(path: str, how: str, seed: int) -> None:
    """Evict the dataset's files, then bring them into the page cache the way `how` says."""
    files = cache.data_files(path)
    if how == "read-through":
        cache.prepare(files, "warm")  # evict, read through, and again while a page is missing
        return
    cache.evict(files)
    dataset = open_raw(path)
    if how == "block-epoch":
        dataset.reader.advise("sequential")
        order = readers.BlockShuffleSampler(dataset, seed=seed)
    else:
        order = readers.ShuffleSampler(dataset, seed=seed)
    for i in order:
        dataset[i]
    dataset.close()


def reader_rate(path: str, seconds: float, seed: int) -> float:
    """Records/s of ds[i] in ShuffleSampler order, epoch after epoch, for about `seconds`."""
    dataset = open_raw(path)
    dataset.open()
    order = readers.ShuffleSampler(dataset, seed=seed)
    n, epoch = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        order.set_epoch(epoch)
        for i in order:
            dataset[i]
            n += 1
        epoch += 1
    rate = n / (time.perf_counter() - start)
    dataset.close()
    return rate


def large_folio_share(files: list[str]) -> float | None:
    """Share of the files' cached pages that belong to large folios, or None where the page
    flags cannot be read (not root, or not Linux). Only cached pages are touched (mincore
    first), so measuring reads nothing from disk."""
    try:
        flags_fd = os.open("/proc/kpageflags", os.O_RDONLY)
    except OSError:
        return None
    large = cached = 0
    try:
        for path in files:
            resident = cache.resident_map(path)
            if not resident.any():
                continue
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = np.frombuffer(mapped, np.uint8)
                pages = np.flatnonzero(resident)
                view[pages * mmap.PAGESIZE].sum()  # map the cached pages into this process
                base = view.ctypes.data // mmap.PAGESIZE
                with open("/proc/self/pagemap", "rb") as pagemap:
                    pagemap.seek(base * 8)
                    entries = np.frombuffer(pagemap.read(len(resident) * 8), np.uint64)
                del view
            frames = (entries[pages] & np.uint64(PFN_MASK)).astype(np.int64)
            for frame in frames.tolist():
                bits = int.from_bytes(os.pread(flags_fd, 8, frame * 8), "little")
                large += (bits >> KPF_COMPOUND_HEAD) & 1 or (bits >> KPF_COMPOUND_TAIL) & 1
            cached += len(pages)
    finally:
        os.close(flags_fd)
    return large / cached if cached else None


def bare_rate(path: str, seconds: float, seed: int) -> float | None:
    dataset = open_raw(path)
    try:
        return BareRead.rate_of_dataset(dataset, seconds, seed)
    finally:
        dataset.close()


def main(argv: list[str] | None = None) -> int:
    parser = _study.parser(__doc__, repeats=2)
    parser.add_argument("--fills", default=",".join(FILLS), help=f"comma-separated, from {','.join(FILLS)}")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per timed rate")
    args = _study.parse(parser, argv)
    fills = [x.strip() for x in args.fills.split(",") if x.strip()]
    unknown = sorted(set(fills) - set(FILLS))
    if unknown:
        parser.error(f"unknown fill(s) {', '.join(unknown)}; choose from {', '.join(FILLS)}")
    files = cache.data_files(args.packed)
    runs = {how: {"reader": [], "bare": [], "resident": [], "large_folios": []} for how in fills}
    for r in range(args.repeats):
        for how in fills:
            fill(args.packed, how, seed=100 + r)
            run = runs[how]
            run["resident"].append(cache.resident_fraction(files))
            run["large_folios"].append(large_folio_share(files))
            run["bare"].append(bare_rate(args.packed, args.seconds, seed=r))
            run["reader"].append(reader_rate(args.packed, args.seconds, seed=r))
    print(f"warm random reads of {args.packed} by how the page cache was filled, median of {args.repeats}")
    print("| filled by | ds[i] records/s | bare pread records/s | ds[i] / bare | pages in large folios | resident |")
    print("|---|---:|---:|---:|---:|---:|")
    for how, run in runs.items():
        reader = statistics.median(run["reader"])
        bare = statistics.median(run["bare"]) if None not in run["bare"] else None
        folios = [x for x in run["large_folios"] if x is not None]
        share = f"{statistics.median(folios):.0%}" if folios else "n/a"
        resident = f"{min(run['resident']):.1%}" if None not in run["resident"] else "n/a"
        print(f"| {how} | {reader:,.0f} | {f'{bare:,.0f}' if bare else 'n/a'} | "
              f"{f'{reader / bare:.2f}' if bare else 'n/a'} | {share} | {resident} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"packed": args.packed, "seconds": args.seconds, "runs": runs},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
