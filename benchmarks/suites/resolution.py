"""Stored resolution against training-read cost: pack time, packed size and decode+RandomResizedCrop(224)
per core, for a corpus packed at full size and with `--max-side` (docs/resolution.md).

    python benchmarks/suites/resolution.py CORPUS --work DIR [--sides full,512,320] [--repeats 5]
        [--pack-repeats 3] [--sample 2000] [--workers N] [--skip-pack] [--json out.json]

Each variant is packed into DIR/<variant>.lmdb with packer.pack (header check, `workers`
processes when re-encoding); the packs run interleaved `pack-repeats` times (a shared machine
drifts) and the median wall time is reported, with the packed image bytes and how many
images were re-encoded. The read side takes the same `sample` records from every variant
(evenly spaced over the split), holds their raw bytes in memory (warm: no I/O is timed),
and times readers.RandomResizedCrop(224, flip=0.5) on the raw bytes, in one process with
torch on one thread, as one DataLoader worker runs it: one untimed warm-up pass, then
`repeats` passes interleaved across variants; the median of this thread's CPU time
(time.thread_time: what one core delivers, far less disturbed by other processes than
wall time) gives samples/s per core. A bare decode (readers.decode.decode_array) column
shows how much of that is the decode.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from packer import open_reader, pack  # noqa: E402
from packer.cores import available_cores  # noqa: E402
from packer.verify import disk_bytes  # noqa: E402


def parse_sides(text: str) -> list[int | None]:
    """"full,512,320" -> [None, 512, 320] (None: stored as packed from the source)."""
    return [None if side == "full" else int(side) for side in text.split(",")]


def variant_name(side: int | None) -> str:
    return "full" if side is None else f"max-side-{side}"


def pack_variants(corpus: str, work: Path, sides: list, repeats: int, workers: int) -> dict:
    """Pack every variant `repeats` times, interleaved; the median wall time and the pack's facts."""
    seconds: dict[str, list[float]] = {variant_name(side): [] for side in sides}
    facts: dict[str, dict] = {}
    for _ in range(repeats):
        for side in sides:
            name = variant_name(side)
            out = work / f"{name}.lmdb"
            start = time.perf_counter()
            result = pack(corpus, "lmdb", str(out), workers=workers, force=True, progress=False, max_side=side)
            seconds[name].append(time.perf_counter() - start)
            meta = result.metadata
            facts[name] = {"path": str(out), "images": meta.count, "image_bytes": meta.bytes,
                           "disk_bytes": disk_bytes(str(out)),
                           "reencoded": sum(meta.reencode["counts"].values()) if meta.reencode else 0}
    for name, times in seconds.items():
        facts[name]["pack_s"] = statistics.median(times)
        facts[name]["pack_s_all"] = times
    return facts


def sample_records(path: str, sample: int) -> list[bytes]:
    """The raw bytes of `sample` records evenly spaced over the dataset (the same ones in every variant)."""
    reader = open_reader(path)
    try:
        count = len(reader)
        step = max(1, count // sample)
        return [reader.read(i)[0] for i in range(0, count, step)][:sample]
    finally:
        reader.close()


def read_rates(samples: dict[str, list[bytes]], repeats: int) -> dict[str, dict]:
    """Per core samples/s of decode+RandomResizedCrop(224)+flip and of bare decode, per variant."""
    import torch

    from readers.decode import decode_array
    from readers.transforms import RandomResizedCrop

    torch.set_num_threads(1)
    cases = {"rrc224": RandomResizedCrop(224, flip=0.5), "decode": decode_array}
    torch.manual_seed(0)
    for datas in samples.values():  # warm-up: code paths, allocator, caches
        for fn in cases.values():
            for data in datas:
                fn(data)
    times = {(name, case): [] for name in samples for case in cases}
    for _ in range(repeats):
        for name, datas in samples.items():
            for case, fn in cases.items():
                start = time.thread_time()
                for data in datas:
                    fn(data)
                times[(name, case)].append(time.thread_time() - start)
    return {name: {f"{case}_per_s": len(datas) / statistics.median(times[(name, case)]) for case in cases}
            for name, datas in samples.items()}


def markdown(facts: dict, rates: dict) -> str:
    full = rates.get("full", {}).get("rrc224_per_s")
    rows = ["| stored | re-encoded | image bytes | pack s (median) | decode+RRC224 samples/s per core | vs full "
            "| decode only samples/s per core |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, fact in facts.items():
        rate = rates[name]
        ratio = f"{rate['rrc224_per_s'] / full:.2f}x" if full else "-"
        rows.append(f"| {name} | {fact['reencoded']:,} of {fact['images']:,} | {fact['image_bytes'] / 1e6:,.0f} MB "
                    f"| {fact['pack_s']:.1f} | {rate['rrc224_per_s']:.0f} | {ratio} | {rate['decode_per_s']:.0f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus")
    parser.add_argument("--work", required=True, help="where the packed variants are written (kept)")
    parser.add_argument("--sides", default="full,512,320")
    parser.add_argument("--repeats", type=int, default=5, help="timed read passes per variant")
    parser.add_argument("--pack-repeats", type=int, default=3, help="packs per variant")
    parser.add_argument("--sample", type=int, default=2000, help="records timed per variant")
    parser.add_argument("--workers", type=int, default=None, help="pack workers [default: the usable cores]")
    parser.add_argument("--skip-pack", action="store_true", help="time the reads of variants packed earlier")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sides = parse_sides(args.sides)
    workers = args.workers or available_cores()
    if args.skip_pack:
        facts = json.loads((work / "packs.json").read_text())
    else:
        facts = pack_variants(args.corpus, work, sides, args.pack_repeats, workers)
        (work / "packs.json").write_text(json.dumps(facts, indent=1))
    samples = {name: sample_records(fact["path"], args.sample) for name, fact in facts.items()}
    rates = read_rates(samples, args.repeats)
    env = {"corpus": os.path.abspath(args.corpus), "pack_workers": workers, "sample": args.sample,
           "repeats": args.repeats, "pack_repeats": args.pack_repeats, "python": platform.python_version(),
           "cpu": platform.processor(), "cores": available_cores(), "read_clock": "thread CPU time, torch 1 thread, bytes in memory",
           "pack_clock": "wall"}
    print(markdown(facts, rates))
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "packs": facts, "reads": rates}, indent=2))


if __name__ == "__main__":
    main()
