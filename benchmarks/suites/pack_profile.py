"""Packing on every core against `tar cf` of the same folder, and where the pack's time goes.

    python benchmarks/suites/pack_profile.py FOLDER --workdir DIR [--formats lmdb,wds]
                                             [--repeats 1] [--cache cold] [--profile FILE] [--json out.json]

Each run starts from the same state (benchmarks.packtime: the source evicted, or loaded
with --cache warm; the last output removed and flushed) and records, beside the wall
time, the CPU seconds of the packing process (its writer, and the reading threads of a
header check) and of its loading processes (packer.engine's, for full checks and
re-encoding; counted once joined), each as cores kept busy over the wall time. A
process near 1 core busy has a serial limit (its writer); processes near the cores
are compute-bound; little of either means the disk. Then one more pack per format
runs under cProfile (the packing process's main thread) and its functions by own time
go to --profile: which calls the writer spends or waits its time in.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cache, packtime  # noqa: E402
from packer.cores import available_cores  # noqa: E402
from packer.output import remove_path  # noqa: E402

FORMATS = ("lmdb", "wds")
TOP = 25  # functions per profile table


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def timed_pack(folder: str, fmt: str, out: str, workers: int, state: str, profile: cProfile.Profile | None = None):
    """One pack from `state`: wall seconds, and the CPU seconds of this process and of its children."""
    import packer

    options = packtime.pack_options(fmt, packtime.tree_bytes(folder), workers)
    packtime.prepare_run(cache.data_files(folder), state, out)
    own, children = cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    try:
        packer.pack(folder, fmt, out, workers=workers, force=True, progress=False, options=options)
    finally:
        if profile is not None:
            profile.disable()
    wall = time.perf_counter() - start
    writer, loaders = cpu_seconds(resource.RUSAGE_SELF) - own, cpu_seconds(resource.RUSAGE_CHILDREN) - children
    return {"seconds": wall, "process_cpu_s": writer, "children_cpu_s": loaders,
            "process_cores_busy": writer / wall, "children_cores_busy": loaders / wall}


def profile_table(profile: cProfile.Profile) -> tuple[str, list]:
    """The profile's functions by own time: as pstats prints them, and the top ones as rows."""
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(TOP)
    rows = sorted(((f"{Path(file).name}:{line}({name})", round(tt, 3), round(ct, 3), calls)
                   for (file, line, name), (_, calls, tt, ct, _) in stats.stats.items()), key=lambda r: -r[1])
    return text.getvalue(), rows[:10]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("folder", help="an ImageFolder tree")
    p.add_argument("--workdir", required=True, help="where the outputs go (removed after)")
    p.add_argument("--formats", type=lambda v: v.split(","), default=list(FORMATS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cache", choices=("cold", "warm"), default="cold")
    p.add_argument("--workers", type=int, help="pack workers (default: every core)")
    p.add_argument("--profile", help="write the cProfile tables here")
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    if args.cache == "cold" and not cache.CAN_EVICT:
        p.error("--cache cold evicts the page cache with posix_fadvise (Linux); pass --cache warm")
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        p.error(f"unknown format(s) {', '.join(unknown)}; formats: {', '.join(FORMATS)}")
    workers = args.workers or available_cores()
    os.makedirs(args.workdir, exist_ok=True)
    tar = packtime.time_tar(args.folder, os.path.join(args.workdir, "reference.tar"), args.repeats, args.cache)
    runs = {"tar": tar, "config": {"workers": workers, "cache": args.cache, "repeats": args.repeats,
                                   "bytes": packtime.tree_bytes(args.folder)}}
    sections = []
    print(f"pack on {workers} workers against tar cf ({args.cache} cache), median of {args.repeats}")
    print("| format | seconds | x tar cf | packing process: cores busy | its children: cores busy |\n"
          "|---|---:|---:|---:|---:|")
    print(f"| tar cf | {tar['median']:.2f} | 1.00 | | |")
    for fmt in args.formats:
        out = os.path.join(args.workdir, f"pack.{fmt}")
        timed = [timed_pack(args.folder, fmt, out, workers, args.cache) for _ in range(args.repeats)]
        median = sorted(timed, key=lambda r: r["seconds"])[len(timed) // 2]
        profile = cProfile.Profile()
        profiled = timed_pack(args.folder, fmt, out, workers, args.cache, profile)
        text, top = profile_table(profile)
        sections.append(f"== pack {fmt}, {workers} workers, {args.cache}, under cProfile: "
                        f"{json.dumps(profiled)}\n{text}")
        remove_path(out)
        runs[fmt] = {**median, "runs": [r["seconds"] for r in timed], "vs_tar": median["seconds"] / tar["median"],
                     "profiled": profiled, "top_own_time": top}
        print(f"| {fmt} | {median['seconds']:.2f} | {runs[fmt]['vs_tar']:.2f} | {median['process_cores_busy']:.2f} | "
              f"{median['children_cores_busy']:.2f} |")
    if args.profile:
        Path(args.profile).write_text("\n\n".join(sections))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
