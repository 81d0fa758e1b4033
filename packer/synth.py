"""Writes a synthetic ImageNet-like folder of JPEGs for the demo, the tests and the benchmarks.

No photos ship with packer, so images are built from smooth random fields, shapes and
sensor-like grain, sized and encoded the way ImageNet's training set is: most have a
500 px long side, many are smaller, a few are large; JPEG quality 75-95, mostly 4:2:0
chroma subsampling, about 2% grayscale. That makes file sizes (~100 KB) and decode costs
close to real data. Every image depends only on (seed, class, index).
"""
from __future__ import annotations

import io
import os
from multiprocessing import Pool

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    u = rng.random()
    if u < 0.40:
        long_side = 500
    elif u < 0.895:
        long_side = int(rng.integers(150, 500))
    elif u < 0.975:
        long_side = int(np.exp(rng.uniform(np.log(500), np.log(1000))))
    else:
        long_side = int(np.exp(rng.uniform(np.log(1000), np.log(2000))))
    aspect = float(rng.choice([4 / 3, 3 / 2, 16 / 9, 1.0], p=[0.55, 0.3, 0.1, 0.05]))
    short_side = max(int(round(long_side / aspect)), 64)
    return (long_side, short_side) if rng.random() < 0.78 else (short_side, long_side)


def smooth_field(rng: np.random.Generator, size: tuple[int, int], cells: int) -> np.ndarray:
    w, h = size
    small = rng.integers(0, 256, size=(max(2, cells * h // w), cells, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize(size, Image.BICUBIC), dtype=np.float32)


def synth_jpeg(seed: int, class_index: int, index: int) -> bytes:
    """One deterministic JPEG: a scene-like field, a few shapes, grain, ImageNet-like encoding."""
    rng = np.random.default_rng([seed, class_index, index])
    size = image_size(rng)
    # Each class leans towards its own palette, so classes differ a little.
    tint = np.random.default_rng([seed, class_index]).uniform(0.7, 1.3, size=3).astype(np.float32)
    base = 0.6 * smooth_field(rng, size, 4) + 0.4 * smooth_field(rng, size, int(rng.integers(12, 40)))
    im = Image.fromarray(np.clip(base * tint, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    w, h = size
    for _ in range(int(rng.integers(2, 8))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(8, max(9, w // 2))), y0 + int(rng.integers(8, max(9, h // 2)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    im = im.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.5))))
    arr = np.asarray(im, dtype=np.float32)
    arr += rng.normal(0.0, float(rng.uniform(4, 16)), size=arr.shape).astype(np.float32)
    im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    if rng.random() < 0.02:
        im = im.convert("L")
    quality = 75 + int(round(20 * rng.beta(5.0, 1.0)))
    subsampling = 2 if (rng.random() < 0.85 and im.mode == "RGB") else 0
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, subsampling=subsampling)
    return buf.getvalue()


def _write_one(job: tuple[int, int, int, str]) -> int:
    seed, class_index, index, path = job
    data = synth_jpeg(seed, class_index, index)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def make_corpus(out: str, classes: int = 10, per_class: int = 20, seed: int = 0,
                splits: dict[str, int] | None = None, workers: int = 1) -> int:
    """Write out/<class>/<class>_<i>.JPEG (or out/<split>/<class>/... when splits gives
    images per class per split); return the number of bytes written."""
    layout = splits or {"": per_class}
    jobs = []
    offset = 0
    for split, n in layout.items():
        for c in range(classes):
            name = f"n{c:08d}"
            folder = os.path.join(out, split, name)
            os.makedirs(folder, exist_ok=True)
            jobs += [(seed, c, offset + i, os.path.join(folder, f"{name}_{offset + i}.JPEG")) for i in range(n)]
        offset += n
    if workers > 1:
        with Pool(workers) as pool:
            written = sum(pool.imap_unordered(_write_one, jobs, chunksize=8))
            # Workers done with their work leave on their own; leaving the block alone would
            # terminate() them by SIGTERM, which a worker of the packer command (its handler
            # inherited) did not always die of: `packer demo` once hung there in CI.
            pool.close()
            pool.join()
            return written
    return sum(map(_write_one, jobs))
