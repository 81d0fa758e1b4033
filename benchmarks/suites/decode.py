"""Single-core decode and decode+augment throughput: simplejpeg vs Pillow, with and without DCT scaling.

    python benchmarks/suites/decode.py [FOLDER] [--repeats 5] [--json out.json]

FOLDER defaults to a fresh 300-image synthetic ImageNet-like corpus. Each case is an
untimed setup, one warm-up pass, then `repeats` timed passes over every image with the
cases interleaved (a shared machine drifts); the median is reported. torch runs on one
thread, as in a DataLoader worker set up by readers.make_loader, and the clock is this
thread's CPU time (time.thread_time), which other processes competing for the cores
disturb far less than wall time. The one-worker DataLoader figures are wall time.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from readers.decode import decode_array  # noqa: E402
from readers.transforms import RandomResizedCrop, ResizeCenterCrop, random_resized_crop_params  # noqa: E402


def pillow_decode(data):
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def pillow_rrc(data):
    """torchvision's PIL pipeline: RandomResizedCrop(224) (bilinear) + RandomHorizontalFlip + to uint8 tensor."""
    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        top, left, h, w = random_resized_crop_params(im.height, im.width)
        im = im.resize((224, 224), Image.BILINEAR, box=(left, top, left + w, top + h))
        if torch.rand(1).item() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)


def pillow_center(data):
    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        w, h = im.size
        nh, nw = (256, int(256 * w / h)) if h <= w else (int(256 * h / w), 256)
        im = im.resize((nw, nh), Image.BILINEAR)
        top, left = int(round((nh - 224) / 2)), int(round((nw - 224) / 2))
        return torch.from_numpy(np.asarray(im.crop((left, top, left + 224, top + 224))).copy()).permute(2, 0, 1)


CASES = {
    "decode: simplejpeg": lambda d: decode_array(d),
    "decode: Pillow": pillow_decode,
    "decode+RRC224: simplejpeg + DCT scale + torch uint8 resize (readers)": RandomResizedCrop(224, flip=0.5),
    "decode+RRC224: simplejpeg + torch uint8 resize, no DCT scale": RandomResizedCrop(224, flip=0.5, dct=False),
    "decode+RRC224: Pillow (torchvision's PIL path)": pillow_rrc,
    "decode+Resize256+CenterCrop224: readers ResizeCenterCrop": ResizeCenterCrop(224),
    "decode+Resize256+CenterCrop224: Pillow": pillow_center,
}


def through_one_worker(folder: str, repeats: int) -> dict:
    """img/s of one DataLoader worker (make_loader, LMDB): bare decode vs decode + RandomResizedCrop(224)."""
    from packer.pack import pack
    from readers import LMDBDataset, make_loader

    packed = pack(folder, "lmdb", tempfile.mkdtemp(prefix="decode-bench-") + "/data.lmdb", progress=False).out
    datasets = {
        "1 worker, LMDB, wall: bare decode (decode='tensor')":
            LMDBDataset(packed, decode="tensor", transform=lambda t: t[:, :1, :1].clone()),
        "1 worker, LMDB, wall: decode + RandomResizedCrop(224) + flip (decode='raw')":
            LMDBDataset(packed, decode="raw", transform=RandomResizedCrop(224, flip=0.5)),
    }
    loaders = {name: make_loader(ds, 32, workers=1, train=False) for name, ds in datasets.items()}
    times = {name: [] for name in loaders}
    for name, loader in loaders.items():
        list(loader)  # start the persistent worker, warm the page cache
    for _ in range(repeats):
        for name, loader in loaders.items():
            start = time.perf_counter()
            n = sum(len(labels) for _, labels in loader)
            times[name].append(time.perf_counter() - start)
    return {name: n / statistics.median(t) for name, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", nargs="?")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = args.folder
    if folder is None:
        from packer.synth import make_corpus

        folder = tempfile.mkdtemp(prefix="decode-bench-")
        make_corpus(folder, classes=10, per_class=30, workers=os.cpu_count() or 1)
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    datas = [p.read_bytes() for p in files]
    times = {name: [] for name in CASES}
    for name, fn in CASES.items():  # warm-up
        for data in datas[:20]:
            fn(data)
    for _ in range(args.repeats):
        for name, fn in CASES.items():
            start = time.thread_time()
            for data in datas:
                fn(data)
            times[name].append(time.thread_time() - start)
    results = {name: len(datas) / statistics.median(t) for name, t in times.items()}
    results.update(through_one_worker(folder, args.repeats))
    env = {"images": len(datas), "folder": folder, "mean_bytes": int(np.mean([len(d) for d in datas])),
           "python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor(),
           "threads": 1, "clock": "thread CPU time (loader rows: wall)", "cache": "warm (files read into memory first)"}
    print("| case | img/s (1 core) |\n|---|---:|")
    for name, rate in results.items():
        print(f"| {name} | {rate:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "img_per_s": results}, indent=2))


if __name__ == "__main__":
    main()
