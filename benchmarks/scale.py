"""Scale study: packing and opening at ImageNet-1k's record count, with memory that stays flat.

    python -m benchmarks.scale corpus --records 1281167 --workdir /var/tmp/scale
    python -m benchmarks.scale run --records 20000 200000 1281167 --workdir /var/tmp/scale

`corpus` writes WORKDIR/corpus-<records>/train/<class>/<name>.JPEG: small JPEG crops
(64-160 px long side, a few KB) cut from the real photos in ../shared/data, 1,000
classes with ImageNet-1k train's class-count skew (most classes 1,300 images, a few
down to 732) scaled to the record count. Small images keep a 1.28M-record corpus within
one machine's disk while the per-record costs (scan, tables, open) are those of the
real thing. Every image depends only on (seed, class, index); a finished corpus is
kept (a marker file) and reused.

`run` packs each corpus into every format and measures, for each record count: pack
wall time and files/s, the packer's peak RSS, a fresh process's open() time, one forked
DataLoader-style worker's RSS and USS (private memory, /proc/PID/smaps_rollup) after
open and after one epoch of random reads, and `packer info` / `packer verify` wall time.
It writes WORKDIR/scale.json and WORKDIR/scale.md (the table).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool

import numpy as np

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


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def load_sources(folder: str) -> list:
    """The shared real photos, decoded once per worker and shrunk to SOURCE_LONG_SIDE."""
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


def _init_worker(folder: str) -> None:
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


def write_class(job: tuple[str, int, int, int]) -> int:
    """Write one class folder; returns the bytes written."""
    root, seed, k, count = job
    folder = os.path.join(root, "train", class_name(k))
    os.makedirs(folder, exist_ok=True)
    written = 0
    rng = np.random.default_rng([seed, k])  # one stream per class: the image depends on (seed, class, index)
    for i in range(count):
        data = crop_jpeg(rng, _SOURCES)
        with open(os.path.join(folder, f"{class_name(k)}_{i}.JPEG"), "wb") as f:
            f.write(data)
        written += len(data)
    return written


def corpus_path(workdir: str, records: int) -> str:
    return os.path.join(workdir, f"corpus-{records}")


def make_corpus(workdir: str, records: int, seed: int = 0, workers: int = 2) -> str:
    """WORKDIR/corpus-<records>, written unless already complete."""
    root = corpus_path(workdir, records)
    if os.path.exists(os.path.join(root, DONE_MARKER)):
        return root
    counts = class_counts(records, seed)
    jobs = [(root, seed, k, int(n)) for k, n in enumerate(counts)]
    start = time.perf_counter()
    total = 0
    with Pool(workers, _init_worker, (os.path.join(SHARED_DATA, "imagenet-sample"),)) as pool:
        for done, nbytes in enumerate(pool.imap_unordered(write_class, jobs), 1):
            total += nbytes
            if done % 100 == 0:
                log(f"corpus {records}: {done}/{len(jobs)} classes, {total / 1e6:.0f} MB, "
                    f"{time.perf_counter() - start:.0f} s")
    with open(os.path.join(root, DONE_MARKER), "w") as f:
        json.dump({"records": records, "bytes": total, "seed": seed}, f)
    return root


# ------------------------------------------------------------------ command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="write the corpora (kept and reused once complete)")
    corpus.add_argument("--records", type=int, nargs="+", default=[IMAGENET_TRAIN_RECORDS])
    corpus.add_argument("--workdir", required=True)
    corpus.add_argument("--workers", type=int, default=2)
    corpus.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "corpus":
        for records in args.records:
            log(f"corpus: {make_corpus(args.workdir, records, args.seed, args.workers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
