"""Scale study: packing and opening at ImageNet-1k's record count, with memory that stays flat.

    python -m benchmarks.scale corpus --records 1281167 --workdir /var/tmp/scale
    python -m benchmarks.scale run --records 20000 200000 1281167 --workdir /var/tmp/scale
    python -m benchmarks.scale tiny --records 20000 1281167 10000000 100000000 --workdir /var/tmp/tiny

`corpus` writes WORKDIR/corpus-<records>/train/<class>/<name>.JPEG: small JPEG crops
(64-160 px long side, a few KB) cut from the real photos in ../shared/data, 1,000
classes with ImageNet-1k train's class-count skew (most classes 1,300 images, a few
down to 732) scaled to the record count. Small images keep a 1.28M-record corpus within
one machine's disk while the per-record costs (scan, tables, open) are those of the
real thing. POOL_SIZE distinct crops are encoded; each file is one of them, picked by
(seed, class, index), with its own name in a JPEG comment so that no two files are the
same bytes. A finished corpus is kept (a marker file) and reused.

`run` packs each corpus into every format and measures, for each record count: pack
wall time and files/s, the packer's peak RSS, a fresh process's open() time, one forked
DataLoader-style worker's RSS and USS (private memory, /proc/PID/smaps_rollup) after
open and after one epoch of random reads, and `packer info` / `packer verify` wall time.
It writes WORKDIR/scale.json and WORKDIR/scale.md (the table).

`tiny` goes further, to 10^8 records and beyond, on packs of tiny synthetic records
(benchmarks.tiny): open, a shuffled loader's first batch, private memory after random
reads and an elastic resume, per record count.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from multiprocessing import Pool

import numpy as np

from .processes import log, memory, open_seconds, timed_process

IMAGENET_TRAIN_RECORDS = 1_281_167
IMAGENET_CLASSES = 1000
IMAGENET_MAX_PER_CLASS = 1300
IMAGENET_MIN_PER_CLASS = 732
# How many of ImageNet-1k's classes hold fewer than 1,300 training images (about a tenth).
SHORT_CLASSES = 100
SHARED_DATA = os.environ.get("PACKER_SHARED_DATA", os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "data"))
DONE_MARKER = ".corpus-complete"
SOURCE_LONG_SIDE = 320  # sources are shrunk once to this; crops are then cheap
# Distinct crops encoded; files draw from them (each made unique by a JPEG comment): encoding
# 1.28M crops would take most of an hour of a shared 2-core machine, writing files minutes.
POOL_SIZE = 20_000


# ------------------------------------------------------------------ class counts

def imagenet_class_counts(seed: int = 0) -> np.ndarray:
    """1,000 per-class counts shaped like ImageNet-1k train: most 1,300, SHORT_CLASSES of them
    fewer, the smallest 732, summing to exactly 1,281,167. Deterministic for a seed."""
    rng = np.random.default_rng([seed, 1300])
    counts = np.full(IMAGENET_CLASSES, IMAGENET_MAX_PER_CLASS, np.int64)
    short = rng.choice(IMAGENET_CLASSES, SHORT_CLASSES, replace=False)
    deficit = IMAGENET_CLASSES * IMAGENET_MAX_PER_CLASS - IMAGENET_TRAIN_RECORDS
    most = IMAGENET_MAX_PER_CLASS - IMAGENET_MIN_PER_CLASS
    # Deficits skewed towards small (most short classes are only a little short), the
    # largest exactly `most`, then adjusted one image at a time to the exact total.
    weights = rng.random(SHORT_CLASSES) ** 2
    weights[0] = weights.max() * 1.0001
    cut = np.minimum(np.floor(weights / weights.max() * most), most).astype(np.int64)
    cut = np.maximum(1, np.floor(cut * (deficit - most) / max(1, cut[1:].sum())).astype(np.int64))
    cut[0] = most
    cut[1:] = np.minimum(cut[1:], most - 1)
    k = 1
    while cut.sum() != deficit:
        step = 1 if cut.sum() < deficit else -1
        if 1 <= cut[k] + step <= most - 1:
            cut[k] += step
        k = k % (SHORT_CLASSES - 1) + 1
    counts[short] -= cut
    assert counts.sum() == IMAGENET_TRAIN_RECORDS and counts.min() == IMAGENET_MIN_PER_CLASS
    return counts


def class_counts(records: int, seed: int = 0) -> np.ndarray:
    """ImageNet's class counts scaled to `records` in all (largest remainder: the exact total)."""
    full = imagenet_class_counts(seed)
    if records == IMAGENET_TRAIN_RECORDS:
        return full
    share = full * records / IMAGENET_TRAIN_RECORDS
    counts = np.floor(share).astype(np.int64)
    rest = records - counts.sum()
    counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
    return counts


def class_name(k: int) -> str:
    return f"n{k:08d}"


# ------------------------------------------------------------------ corpus

_SOURCES: list = []
_POOL: list[bytes] = []  # the distinct crops, made before the writers fork (they inherit it)


def load_sources(folder: str) -> list:
    """The shared real photos, decoded once and shrunk to SOURCE_LONG_SIDE."""
    from PIL import Image

    photos = []
    for top, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(files):
            if name.lower().endswith((".jpeg", ".jpg")):
                with Image.open(os.path.join(top, name)) as im:
                    im.draft("RGB", (SOURCE_LONG_SIDE, SOURCE_LONG_SIDE))
                    im = im.convert("RGB")
                    im.thumbnail((SOURCE_LONG_SIDE, SOURCE_LONG_SIDE))
                    photos.append(im)
    if not photos:
        raise SystemExit(f"{folder}: no JPEG photos to cut the corpus from (set PACKER_SHARED_DATA)")
    return photos


def _init_crops(folder: str) -> None:
    global _SOURCES
    os.nice(10)
    _SOURCES = load_sources(folder)


def crop_jpeg(rng: np.random.Generator, sources: list) -> bytes:
    """A random crop of a random source photo, 64-160 px long side, JPEG quality 75-95."""
    import simplejpeg
    from PIL import Image

    photo = sources[int(rng.integers(len(sources)))]
    w, h = photo.size
    area = rng.uniform(0.1, 1.0) * h * w
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    ch, cw = min(h, max(8, int(np.sqrt(area / aspect)))), min(w, max(8, int(np.sqrt(area * aspect))))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    long_side = int(rng.integers(64, 161))
    scale = long_side / max(ch, cw)
    size = (max(16, round(cw * scale)), max(16, round(ch * scale)))
    # Nearest to twice the size, then a 2x2 box average: antialiased, and many times
    # cheaper than Pillow's bilinear filter on a shared 2-core machine.
    im = photo.resize((2 * size[0], 2 * size[1]), Image.NEAREST, box=(x, y, x + cw, y + ch)).reduce(2)
    if rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return simplejpeg.encode_jpeg(np.asarray(im), quality=int(rng.integers(75, 96)), colorspace="RGB",
                                  colorsubsampling="420" if rng.random() < 0.9 else "444")


def make_crops(job: tuple[int, int, int]) -> list[bytes]:
    """Crops start..stop of the pool, each from its own seeded stream."""
    seed, start, stop = job
    return [crop_jpeg(np.random.default_rng([seed, 7, k]), _SOURCES) for k in range(start, stop)]


def make_pool(size: int, seed: int, workers: int) -> list[bytes]:
    step = 500
    jobs = [(seed, a, min(size, a + step)) for a in range(0, size, step)]
    with Pool(workers, _init_crops, (os.path.join(SHARED_DATA, "imagenet-sample"),)) as pool:
        return [crop for part in pool.map(make_crops, jobs) for crop in part]


def unique_jpeg(crop: bytes, name: str) -> bytes:
    """crop with a JPEG comment segment (COM) naming the file after its SOI marker: every
    file's bytes differ (CRCs, checksums), and it is still the same valid JPEG."""
    text = name.encode()
    return crop[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + crop[2:]


def write_class(job: tuple[str, int, int, int]) -> int:
    """Write one class folder from the pool; returns the bytes written."""
    root, seed, k, count = job
    folder = os.path.join(root, "train", class_name(k))
    os.makedirs(folder, exist_ok=True)
    picks = np.random.default_rng([seed, k]).integers(0, len(_POOL), count).tolist()
    written = 0
    for i, pick in enumerate(picks):
        name = f"{class_name(k)}_{i}.JPEG"
        data = unique_jpeg(_POOL[pick], name)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
        written += len(data)
    return written


def _init_writer() -> None:
    os.nice(10)


def corpus_path(workdir: str, records: int) -> str:
    return os.path.join(workdir, f"corpus-{records}")


def make_corpus(workdir: str, records: int, seed: int = 0, workers: int = 2) -> str:
    """WORKDIR/corpus-<records>, written unless already complete."""
    root = corpus_path(workdir, records)
    if os.path.exists(os.path.join(root, DONE_MARKER)):
        return root
    global _POOL
    counts = class_counts(records, seed)
    jobs = [(root, seed, k, int(n)) for k, n in enumerate(counts)]
    start = time.perf_counter()
    _POOL = make_pool(min(records, POOL_SIZE), seed, workers)
    log(f"corpus {records}: {len(_POOL)} distinct crops in {time.perf_counter() - start:.0f} s")
    total = 0
    with Pool(workers, _init_writer) as pool:
        for done, nbytes in enumerate(pool.imap_unordered(write_class, jobs), 1):
            total += nbytes
            if done % 100 == 0:
                log(f"corpus {records}: {done}/{len(jobs)} classes, {total / 1e6:.0f} MB, "
                    f"{time.perf_counter() - start:.0f} s")
    with open(os.path.join(root, DONE_MARKER), "w") as f:
        json.dump({"records": records, "bytes": total, "seed": seed, "distinct_crops": len(_POOL)}, f)
    return root


# ------------------------------------------------------------------ measuring

FORMATS = ("lmdb", "hdf5", "wds")
EXTENSIONS = {"lmdb": ".lmdb", "hdf5": ".h5", "wds": ".wds"}


def packer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "packer", *args]


def pack_path(workdir: str, records: int, fmt: str) -> str:
    return os.path.join(workdir, "packs", f"{records}{EXTENSIONS[fmt]}")


def tree_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(top, name)) for top, _, names in os.walk(path) for name in names)


def probe_worker(out: str, epoch_seconds: float, seed: int = 0) -> dict:
    """Memory of one DataLoader-style worker: the parent opens the dataset (as the main
    process or another rank does), then a forked worker gets the reader pickled (as a
    spawned worker or another rank gets it: tables left out, loaded afresh) and opens it,
    then reads records in a random order (one epoch, or as many as epoch_seconds allow).
    Memory is measured in the worker before open, after open and after the reads."""
    import pickle

    from packer import open_reader

    parent = open_reader(out, split="train")
    parent.open()
    sent = pickle.dumps(parent)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            os.close(rfd)
            reader = pickle.loads(sent)
            order = np.random.default_rng(seed).permutation(len(reader))  # the harness's own, made first
            # A collection writes to every object the parent left, copying their pages: done
            # now, so that what the measurements show is the reader's.
            __import__("gc").collect()
            found = {"pickled_bytes": len(sent), "before_open": memory()}
            start = time.perf_counter()
            reader.open()
            found["open_s"] = time.perf_counter() - start
            found["after_open"] = memory()
            start, done = time.perf_counter(), 0
            for chunk in range(0, len(order), 4096):
                for i in order[chunk:chunk + 4096].tolist():
                    reader.read_image(i)
                done = min(len(order), chunk + 4096)
                if time.perf_counter() - start > epoch_seconds:
                    break
            found["read_s"] = time.perf_counter() - start
            found["records_read"] = done
            found["after_epoch"] = memory()
            os.write(wfd, json.dumps(found).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        raw = f.read()
    os.waitpid(pid, 0)
    found = json.loads(raw)
    for stage in ("after_open", "after_epoch"):
        for key in ("uss", "private_dirty"):
            found[stage][f"{key}_growth_mb"] = found[stage][f"{key}_mb"] - found["before_open"][f"{key}_mb"]
    return found


def measure(workdir: str, records: int, fmt: str, epoch_seconds: float, keep: bool,
            verify_seconds: float | None) -> dict:
    src = corpus_path(workdir, records)
    out = pack_path(workdir, records, fmt)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    log(f"{records} {fmt}: pack")
    packed = timed_process(packer_cmd("pack", src, "--to", fmt, "--out", out, "--force"))
    os.sync()  # the pack's written pages reach the disk now, not while open() is timed
    row = {"records": records, "format": fmt, "pack_s": packed["wall_s"], "files_per_s": records / packed["wall_s"],
           "pack_peak_rss_mb": packed["peak_rss_mb"], "pack_peak_anon_mb": packed["peak_anon_mb"],
           "pack_bytes": tree_size(out)}
    log(f"{records} {fmt}: open")
    row.update(open_seconds(out))
    log(f"{records} {fmt}: worker")
    row["worker"] = json.loads(timed_process([sys.executable, "-m", "benchmarks.scale", "probe", out,
                                              "--epoch-seconds", str(epoch_seconds)])["output"].strip()
                               .splitlines()[-1])
    log(f"{records} {fmt}: info, verify")
    row["info_s"] = timed_process(packer_cmd("info", out))["wall_s"]
    verified = timed_process(packer_cmd("verify", out, "--check", "header"), timeout=verify_seconds)
    row["verify_s"], row["verify_peak_rss_mb"] = verified["wall_s"], verified["peak_rss_mb"]
    row["verify_timed_out"] = verified["timed_out"]
    if not keep:
        shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    log(f"{records} {fmt}: {json.dumps(row)}")
    return row


def remeasure_open(workdir: str, counts: list[int], formats: list[str]) -> dict:
    """open() measured again on a run's kept packs, after os.sync(), into its rows."""
    results_path = os.path.join(workdir, "scale.json")
    with open(results_path) as f:
        results = json.load(f)
    os.sync()
    for row in results["rows"]:
        if row["records"] in counts and row["format"] in formats:
            row.update(open_seconds(pack_path(workdir, row["records"], row["format"])))
            log(f"{row['records']} {row['format']}: open {row['open_s']:.3f} s {row['open_s_runs']}")
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(workdir, "scale.md"), "w") as f:
        f.write(table(results))
    return results


def machine_facts() -> dict:
    from packer.cores import available_cores

    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    return {"cores": available_cores(), "memory_gb": round(total / 1e9, 1), "python": sys.version.split()[0],
            "note": "shared machine (other jobs running): times are indicative, memory figures are not affected"}


def run(workdir: str, counts: list[int], formats: list[str], epoch_seconds: float, keep: bool,
        verify_seconds: float | None = None) -> dict:
    results_path = os.path.join(workdir, "scale.json")
    results = {"machine": machine_facts(), "rows": []}
    if os.path.exists(results_path):
        with open(results_path) as f:
            results["rows"] = json.load(f)["rows"]
    for records in counts:
        make_corpus(workdir, records)
        for fmt in formats:
            row = measure(workdir, records, fmt, epoch_seconds, keep, verify_seconds)
            results["rows"] = [r for r in results["rows"] if (r["records"], r["format"]) != (records, fmt)] + [row]
            results["rows"].sort(key=lambda r: (r["records"], FORMATS.index(r["format"])))
            with open(results_path, "w") as f:
                json.dump(results, f, indent=1)
            with open(os.path.join(workdir, "scale.md"), "w") as f:
                f.write(table(results))
    return results


def table(results: dict) -> str:
    """The Markdown table of a run."""
    head = ("| records | format | pack s | files/s | pack peak RSS MB (anon) | open s | worker USS after open MB "
            "(growth) | worker after epoch: USS MB (growth), private dirty growth | records read | info s | "
            "verify s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in results["rows"]:
        w = r["worker"]
        verify = f"{'>' if r.get('verify_timed_out') else ''}{r['verify_s']:.1f}"
        lines.append(f"| {r['records']:,} | {r['format']} | {r['pack_s']:.1f} | {r['files_per_s']:,.0f} | "
                     f"{r['pack_peak_rss_mb']:.0f} ({r['pack_peak_anon_mb']:.0f}) | {r['open_s']:.3f} | "
                     f"{w['after_open']['uss_mb']:.1f} ({w['after_open']['uss_growth_mb']:+.1f}) | "
                     f"{w['after_epoch']['uss_mb']:.1f} ({w['after_epoch']['uss_growth_mb']:+.1f}), "
                     f"{w['after_epoch']['private_dirty_growth_mb']:+.1f} | "
                     f"{w['records_read']:,} | {r['info_s']:.2f} | {verify} |")
    return "\n".join(lines) + "\n"


def markdown(results: dict) -> str:
    """The results page's table of a committed scale.json (docs/sync.py)."""
    return table(results)


# ------------------------------------------------------------------ command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="write the corpora (kept and reused once complete)")
    corpus.add_argument("--records", type=int, nargs="+", default=[IMAGENET_TRAIN_RECORDS])
    corpus.add_argument("--workdir", required=True)
    corpus.add_argument("--workers", type=int, default=2)
    corpus.add_argument("--seed", type=int, default=0)
    runner = sub.add_parser("run", help="pack each corpus into each format and measure")
    runner.add_argument("--records", type=int, nargs="+", default=[20_000, 200_000, IMAGENET_TRAIN_RECORDS])
    runner.add_argument("--workdir", required=True)
    runner.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    runner.add_argument("--epoch-seconds", type=float, default=600,
                        help="stop the worker's random-read epoch after this long (the row says how many were read)")
    runner.add_argument("--keep", action="store_true", help="keep the packs (default: deleted once measured)")
    runner.add_argument("--verify-seconds", type=float, default=None,
                        help="stop packer verify after this long (the table shows >N)")
    reopen = sub.add_parser("reopen", help="measure open() again on the kept packs of a run (updates its rows)")
    reopen.add_argument("--records", type=int, nargs="+", required=True)
    reopen.add_argument("--workdir", required=True)
    reopen.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    tiny = sub.add_parser("tiny", help="synthetic tiny-record packs: open, first batch, memory, resume")
    tiny.add_argument("--records", type=int, nargs="+", default=[20_000, IMAGENET_TRAIN_RECORDS, 10_000_000])
    tiny.add_argument("--workdir", required=True)
    tiny.add_argument("--format", choices=FORMATS, default="hdf5")
    tiny.add_argument("--keep", action="store_true", help="keep the packs (default: deleted once measured)")
    tiny.add_argument("--stream", action="store_true",
                      help="with --format wds: read by WDSDataset's stream, not the map-style Dataset")
    tiny_pack = sub.add_parser("tiny-pack", help="(internal) write one tiny-record pack")
    tiny_pack.add_argument("out")
    tiny_pack.add_argument("--records", type=int, required=True)
    tiny_pack.add_argument("--format", choices=FORMATS, default="hdf5")
    sub.add_parser("tiny-sampler", help="each sampler alone over 10^9 items: first indexes, fresh and resumed")
    tiny_shards = sub.add_parser("tiny-shards", help="a WDSDataset's shard list at LAION-400M's layout: its memory")
    tiny_shards.add_argument("--workdir", required=True)
    tiny_probe = sub.add_parser("tiny-probe", help="(internal) open, load, read and resume one pack, as JSON")
    tiny_probe.add_argument("packed")
    tiny_probe.add_argument("--stream", action="store_true")
    probe = sub.add_parser("probe", help="(internal) one worker's memory, printed as JSON")
    probe.add_argument("packed")
    probe.add_argument("--epoch-seconds", type=float, default=600)
    args = parser.parse_args(argv)
    if args.command == "corpus":
        for records in args.records:
            log(f"corpus: {make_corpus(args.workdir, records, args.seed, args.workers)}")
    elif args.command == "reopen":
        print(table(remeasure_open(args.workdir, args.records, args.formats)), end="")
    elif args.command in ("tiny", "tiny-pack", "tiny-probe", "tiny-sampler", "tiny-shards"):
        from . import tiny as study  # imports scale's helpers: loaded only when asked for
        if args.command == "tiny":
            print(study.table(study.run(args.workdir, args.records, args.format, args.keep, args.stream)), end="")
        elif args.command == "tiny-sampler":
            import readers
            for kind in (readers.ShuffleSampler, readers.BlockShuffleSampler):
                print(json.dumps(study.sampler_start(kind)))
        elif args.command == "tiny-shards":
            print(json.dumps(study.shard_list_cost(args.workdir)))
        elif args.command == "tiny-pack":
            study.write_tiny_pack(args.out, args.records, args.format)
        else:
            print(json.dumps(study.probe(args.packed, args.stream)))
    elif args.command == "run":
        print(table(run(args.workdir, args.records, args.formats, args.epoch_seconds, args.keep,
                        args.verify_seconds)), end="")
    else:
        print(json.dumps(probe_worker(args.packed, args.epoch_seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
