"""Stored resolution and JPEG form against training-read cost: pack time, packed size and
decode+RandomResizedCrop(224) per core, for a corpus packed at full size and with `--max-side`
and/or `--baseline-420` (docs/resolution.md).

    python benchmarks/suites/resolution.py CORPUS --work DIR [--sides full,512,320,b420,512+b420]
        [--repeats 5] [--pack-repeats 3] [--sample 2000] [--workers N] [--skip-pack] [--every-q90]
        [--json out.json] [--time-variant NAME]

A variant is "full" (as packed from the source), a max side N, "b420" (--baseline-420), or
N+b420 (both).

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
shows how much of that is the decode. --every-q90 adds a read-only variant: the full
sample's records each re-encoded as baseline 4:2:0 JPEG at quality 90 whatever their form, as
FFCV stores them, which separates the gain of the form from that of the lower quality.
--time-variant NAME (after a pack) only decodes+crops NAME's sample `repeats` times and
prints its rate: a whole process to time from outside, one variant at a time.
"""
from __future__ import annotations

import argparse
import io
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


B420 = "b420"


def parse_sides(text: str) -> list[tuple[int | None, bool]]:
    """"full,512,b420,320+b420" -> [(None, False), (512, False), (None, True), (320, True)]:
    (max side, baseline 4:2:0); (None, False) is stored as packed from the source."""
    variants = []
    for item in text.split(","):
        words = item.split("+")
        side = next((int(word) for word in words if word not in ("full", B420)), None)
        variants.append((side, B420 in words))
    return variants


def variant_name(variant: tuple[int | None, bool]) -> str:
    side, b420 = variant
    names = ([] if side is None else [f"max-side-{side}"]) + (["baseline-420"] if b420 else [])
    return "+".join(names) or "full"


def pack_variants(corpus: str, work: Path, sides: list, repeats: int, workers: int) -> dict:
    """Pack every variant `repeats` times, interleaved; the median wall time and the pack's facts."""
    seconds: dict[str, list[float]] = {variant_name(variant): [] for variant in sides}
    facts: dict[str, dict] = {}
    for _ in range(repeats):
        for side, b420 in sides:
            name = variant_name((side, b420))
            out = work / f"{name}.lmdb"
            start = time.perf_counter()
            result = pack(corpus, "lmdb", str(out), workers=workers, force=True, progress=False, max_side=side,
                          baseline_420=b420)
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


def every_q90(datas: list[bytes]) -> list[bytes]:
    """Each record re-encoded as a baseline 4:2:0 (or grayscale) JPEG at quality 90, as FFCV
    stores its JPEGs: no record kept as it is."""
    from PIL import Image

    from packer.reencode import _encode

    out = []
    for data in datas:
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("L" if image.mode == "L" else "RGB")
            out.append(_encode(image, 90))
    return out


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
        pack_s = "- (sample only)" if fact.get("sample_only") else f"{fact['pack_s']:.1f}"
        rows.append(f"| {name} | {fact['reencoded']:,} of {fact['images']:,} | {fact['image_bytes'] / 1e6:,.0f} MB "
                    f"| {pack_s} | {rate['rrc224_per_s']:.0f} | {ratio} | {rate['decode_per_s']:.0f} |")
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
    parser.add_argument("--every-q90", action="store_true", help="add the full sample re-encoded at quality 90")
    parser.add_argument("--time-variant", help="only decode+crop this packed variant's sample, repeats times")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.time_variant:
        return time_variant(Path(args.work), args.time_variant, args.sample, args.repeats)
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
    if args.every_q90 and "full" in samples:
        samples["every-q90"] = every_q90(samples["full"])
        facts["every-q90"] = {"images": len(samples["every-q90"]), "reencoded": len(samples["every-q90"]),
                              "image_bytes": sum(map(len, samples["every-q90"])), "pack_s": float("nan"),
                              "sample_only": True}
    rates = read_rates(samples, args.repeats)
    for name, datas in samples.items():  # the timed records' bytes: every-q90 compares with full's here
        rates[name]["sample_bytes"] = sum(map(len, datas))
    env = {"corpus": os.path.abspath(args.corpus), "pack_workers": workers, "sample": args.sample,
           "repeats": args.repeats, "pack_repeats": args.pack_repeats, "python": platform.python_version(),
           "cpu": platform.processor(), "cores": available_cores(), "read_clock": "thread CPU time, torch 1 thread, bytes in memory",
           "pack_clock": "wall"}
    print(markdown(facts, rates))
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "packs": facts, "reads": rates}, indent=2))


def time_variant(work: Path, name: str, sample: int, repeats: int) -> None:
    """Decode+RandomResizedCrop(224) the sample of one packed variant, repeats passes, after a warm-up."""
    import torch

    from readers.transforms import RandomResizedCrop

    torch.set_num_threads(1)
    torch.manual_seed(0)
    datas = sample_records(str(work / f"{name}.lmdb"), sample)
    crop = RandomResizedCrop(224, flip=0.5)
    for data in datas:
        crop(data)
    start = time.thread_time()
    for _ in range(repeats):
        for data in datas:
            crop(data)
    print(f"{name}: {len(datas) * repeats / (time.thread_time() - start):.0f} samples/s per core")


if __name__ == "__main__":
    main()
