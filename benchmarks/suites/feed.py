"""Does the loader keep a GPU busy? A ResNet-50-sized training step fed from LMDBDataset two ways.

    python benchmarks/suites/feed.py [--images 4000] [--batch 256] [--steps 60] [--json out.json]

- "defaults": torch's DataLoader defaults (num_workers=0, no pinning), the torchvision-style
  Pillow RandomResizedCrop + flip, float32 normalised on the CPU, synchronous `.cuda()`;
- "defaults+workers": the same with as many workers as make_loader picks;
- "make_loader": decode="raw" + readers.RandomResizedCrop (uint8), make_loader(device="cuda")
  with its CUDAPrefetcher (pinned uint8 copies on a side stream, normalise on the GPU).

Per step, data wait (next() plus any copy) and step time (forward, backward, optimizer,
then a device sync so GPU time counts) are measured; the first `--warmup` steps are left
out. Without CUDA it runs the same code on the CPU with a small model (a smoke test of
the plumbing, not a measurement of the claim).
"""
from __future__ import annotations

import argparse
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
import torch.nn as nn
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import readers  # noqa: E402
from packer.pack import pack  # noqa: E402
from packer.synth import make_corpus  # noqa: E402
from readers.transforms import random_resized_crop_params  # noqa: E402

MEAN = torch.tensor(readers.IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(readers.IMAGENET_STD).view(3, 1, 1)


def pillow_train_transform(image: Image.Image) -> torch.Tensor:
    """torchvision's RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize, on PIL."""
    top, left, h, w = random_resized_crop_params(image.height, image.width)
    image = image.resize((224, 224), Image.BILINEAR, box=(left, top, left + w, top + h))
    if torch.rand(1).item() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float().div_(255)
    return (x - MEAN) / STD


def model_for(device: torch.device) -> nn.Module:
    if device.type == "cuda":
        try:
            import torchvision

            return torchvision.models.resnet50(num_classes=1000)
        except ImportError:
            pass
    width = 64 if device.type == "cuda" else 8
    layers, c = [], 3
    for i, out in enumerate([width, width * 2, width * 4, width * 8]):
        layers += [nn.Conv2d(c, out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
        if device.type == "cuda":
            layers += [nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)] * 2
        c = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 1000))


def run(name, batches, device, model, steps, warmup, copy_sync):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    waits, step_times, n = [], [], 0
    iterator = iter(batches)
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        try:
            images, labels = next(iterator)
        except StopIteration:
            iterator = iter(batches)
            images, labels = next(iterator)
        if copy_sync:
            images, labels = images.to(device), labels.to(device)
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            waits.append(t1 - t0)
            step_times.append(t2 - t1)
            n += len(labels)
    wait, step = sum(waits), sum(step_times)
    return {"case": name, "wait_fraction": wait / (wait + step), "median_wait_ms": 1e3 * statistics.median(waits),
            "median_step_ms": 1e3 * statistics.median(step_times), "samples_per_s": n / (wait + step)}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        args.images, args.batch = min(args.images, 100), min(args.batch, 8)
        args.steps, args.warmup = min(args.steps, 6), 2
    work = tempfile.mkdtemp(prefix="feed-bench-")
    make_corpus(os.path.join(work, "src"), classes=100, per_class=max(1, args.images // 100),
                workers=os.cpu_count() or 1)
    packed = pack(os.path.join(work, "src"), "lmdb", os.path.join(work, "data.lmdb"), progress=False).out
    workers = readers.loader.default_workers() if args.workers is None else args.workers
    model = model_for(device).to(device, memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    results = []

    pil = readers.LMDBDataset(packed, decode="pil", transform=pillow_train_transform)
    results.append(run("defaults", torch.utils.data.DataLoader(pil, args.batch, shuffle=True, drop_last=True),
                       device, model, args.steps, args.warmup, copy_sync=True))
    results.append(run("defaults+workers", torch.utils.data.DataLoader(
        pil, args.batch, shuffle=True, drop_last=True, num_workers=workers), device, model, args.steps,
        args.warmup, copy_sync=True))
    raw = readers.LMDBDataset(packed, decode="raw", transform=readers.RandomResizedCrop(224, flip=0.5))
    fed = readers.make_loader(raw, args.batch, device=device, workers=workers, mean=readers.IMAGENET_MEAN,
                              std=readers.IMAGENET_STD, channels_last=True)
    results.append(run("make_loader", fed, device, model, args.steps, args.warmup, copy_sync=False))

    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "workers": workers, "cores": readers.loader.available_cores(),
           "batch": args.batch, "images": args.images, "steps": args.steps, "warmup": args.warmup,
           "model": type(model).__name__, "cache": "page cache warm after packing"}
    print(json.dumps(env))
    print("| case | data wait | wait ms | step ms | samples/s |\n|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['case']} | {r['wait_fraction']:.1%} | {r['median_wait_ms']:.1f} | {r['median_step_ms']:.1f} "
              f"| {r['samples_per_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=2))


if __name__ == "__main__":
    main()
