"""Does the loader keep a GPU busy? A ResNet-50-sized training step fed from LMDBDataset two ways.

    python benchmarks/suites/feed.py [--images 4000] [--batch 256] [--steps 60] [--json out.json]
    python benchmarks/suites/feed.py --lmdb DATA.lmdb --max-seconds 60   # an LMDB packed already

- "defaults": torch's DataLoader defaults (num_workers=0, no pinning), the torchvision-style
  Pillow RandomResizedCrop + flip, float32 normalised on the CPU, synchronous `.cuda()`;
- "defaults+workers": the same with as many workers as make_loader picks;
- "make_loader": decode="raw" + readers.RandomResizedCrop (uint8), make_loader(device="cuda")
  with its CUDAPrefetcher (pinned uint8 copies on a side stream, normalise on the GPU);
- "make_loader_gpu_decode", "make_loader_hybrid" (named in --cases only): the same with
  gpu_decode=True / "hybrid" (nvJPEG; CUDA only, else skipped).

--model resnet18 and --size 160 give the frontier's faster step (ResNet-50 at 224 is the default).

Per step, data wait (next() plus any copy, until the batch is on the device: the consumer
stream is synchronized after next()) and step time (forward, backward, optimizer, then a
device sync so GPU time counts) are measured; the first `--warmup` steps are left out, and
a case also ends after `--max-seconds`. GPU utilisation is sampled with NVML (pynvml, from
nvidia-ml-py; optional) every 0.1 s over the timed steps. Without CUDA it runs the same
code on the CPU with a small model (a smoke test of the plumbing, not a measurement of the
claim).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
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


CASES = ("defaults", "defaults+workers", "make_loader")
GPU_CASES = {"make_loader_gpu_decode": True, "make_loader_hybrid": "hybrid"}  # case -> make_loader's gpu_decode
MODELS = ("resnet50", "resnet18")


def model_for(device: torch.device, name: str = "resnet50") -> nn.Module:
    if device.type == "cuda":
        try:
            import torchvision

            return getattr(torchvision.models, name)(num_classes=1000)
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


class Utilisation:
    """GPU (and JPEG engine) utilisation sampled with NVML in a thread, between start() and stop().

    nvmlDeviceGetUtilizationRates gives the share of the last sample period (1/6 s to 1 s,
    by GPU) in which a kernel ran; the JPEG figure is the hardware decoders' (NVJPG) share,
    which says whether nvJPEG's hardware backend is in use. Without pynvml or a GPU every
    figure is absent and `reason` says why.
    """

    def __init__(self, device: torch.device, period: float = 0.1):
        self.period, self.gpu, self.jpg = period, [], []
        self.reason, self._nvml, self._handle = None, None, None
        self._stop, self._thread = threading.Event(), None
        if device.type != "cuda":
            self.reason = "no CUDA device"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._nvml = pynvml
        except Exception as exc:  # ImportError, or NVML missing/refusing: utilisation is optional
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"

    def _sample(self) -> None:
        jpg = getattr(self._nvml, "nvmlDeviceGetJpgUtilization", None)
        while not self._stop.wait(self.period):
            try:
                self.gpu.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                if jpg is not None:
                    self.jpg.append(jpg(self._handle)[0])
            except Exception as exc:  # e.g. NVML_ERROR_NOT_SUPPORTED for the JPEG counter
                if not self.gpu:
                    self.reason = f"NVML sampling failed: {type(exc).__name__}: {exc}"
                    return
                jpg = None

    def start(self) -> "Utilisation":
        if self._nvml is not None and self._thread is None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if not self.gpu:
            return {"gpu_util": None, "reason": self.reason or "no samples (the run was shorter than a period)"}
        out = {"gpu_util": {"mean": statistics.fmean(self.gpu), "median": statistics.median(self.gpu),
                            "min": min(self.gpu), "samples": len(self.gpu), "period_s": self.period}}
        if self.jpg:
            out["jpg_util"] = {"mean": statistics.fmean(self.jpg), "max": max(self.jpg)}
        return out


def run(name, batches, device, model, steps, warmup, copy_sync, max_seconds=None):
    """One case: `warmup` untimed steps, then up to `steps` timed ones or `max_seconds` in all."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    waits, step_times, n = [], [], 0
    utilisation = Utilisation(device)
    started = time.perf_counter()
    iterator = iter(batches)
    try:
        for i in range(steps + warmup):
            if i == warmup:
                utilisation.start()
            t0 = time.perf_counter()
            try:
                images, labels = next(iterator)
            except StopIteration:
                iterator = iter(batches)
                images, labels = next(iterator)
            if copy_sync:
                images, labels = images.to(device), labels.to(device)
            if device.type == "cuda":
                # The last step ended synchronized: what the stream still runs is this batch's copy.
                torch.cuda.current_stream(device).synchronize()
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
            if max_seconds is not None and t2 - started >= max_seconds and len(waits) >= 3:
                break
    finally:
        util = utilisation.stop()
        del iterator  # shuts a DataLoader's workers down
    if not waits:
        raise RuntimeError(f"{name}: no timed step within {max_seconds} s (warm-up {warmup} steps)")
    wait, step = sum(waits), sum(step_times)
    return {"case": name, "wait_fraction": wait / (wait + step), "median_wait_ms": 1e3 * statistics.median(waits),
            "median_step_ms": 1e3 * statistics.median(step_times), "samples_per_s": n / (wait + step),
            "steps_timed": len(waits), "batch": len(labels), **util}


def feed_check(packed: str, device: torch.device, batch: int = 256, steps: int = 60, warmup: int = 10,
               workers: int | None = None, max_seconds: float | None = None, on_result=None,
               model_name: str = "resnet50", size: int = 224, cases=CASES) -> dict:
    """The cases on the LMDB at `packed`: {"env": ..., "results": [...]}. on_result(partial)
    is called after each case, so a caller can save what is done before a later case fails."""
    workers = readers.loader.default_workers() if workers is None else workers
    model = model_for(device, model_name).to(device, memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "workers": workers, "cores": readers.loader.available_cores(),
           "batch": batch, "steps": steps, "warmup": warmup, "max_seconds": max_seconds,
           "model": model_name if device.type == "cuda" else type(model).__name__, "size": size, "channels_last": True,
           "autocast": "bfloat16" if device.type == "cuda" else "off (CPU smoke run)",
           "cache": "page cache warm after packing"}
    out = {"env": env, "results": []}

    def case(name, loader, copy_sync):
        try:
            out["results"].append(run(name, loader, device, model, steps, warmup, copy_sync, max_seconds))
        except Exception as exc:  # one failed case is a result; the others still run
            out["results"].append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
        if on_result is not None:
            on_result(out)

    pil = readers.LMDBDataset(packed, decode="pil", transform=pillow_train_transform)
    pin = device.type == "cuda"
    crop = readers.RandomResizedCrop(size, flip=0.5)
    for name in cases:
        if name in ("defaults", "defaults+workers"):
            case(name, torch.utils.data.DataLoader(pil, batch, shuffle=True, drop_last=True,
                                                   num_workers=workers if name != "defaults" else 0), True)
        elif name == "make_loader":
            raw = readers.LMDBDataset(packed, decode="raw", transform=crop)
            case(name, readers.make_loader(raw, batch, device=device, workers=workers, mean=readers.IMAGENET_MEAN,
                                           std=readers.IMAGENET_STD, channels_last=True, pin_memory=pin), False)
        elif device.type != "cuda":
            out["results"].append({"case": name, "skipped": "gpu_decode needs CUDA"})
        else:
            decoder = GPU_CASES[name]
            if size != 224:  # make_loader's own engine crops to 224: give it the size asked for
                from readers.hybrid import HybridDecoder
                from readers.nvjpeg import GPUDecoder

                decoder = GPUDecoder(crop, device)
                decoder = HybridDecoder(decoder) if GPU_CASES[name] == "hybrid" else decoder
            raw = readers.LMDBDataset(packed, decode="raw")
            case(name, readers.make_loader(raw, batch, device=device, workers=workers, mean=readers.IMAGENET_MEAN,
                                           std=readers.IMAGENET_STD, channels_last=True, gpu_decode=decoder), False)
    return out


def table(results: list[dict]) -> str:
    lines = ["| case | data wait | wait ms | step ms | samples/s | GPU util |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['case']} | skipped: {r['skipped']} | | | | |")
            continue
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} | | | | |")
            continue
        util = r.get("gpu_util")
        lines.append(f"| {r['case']} | {r['wait_fraction']:.1%} | {r['median_wait_ms']:.1f} | "
                     f"{r['median_step_ms']:.1f} | {r['samples_per_s']:.0f} | "
                     f"{'–' if not util else format(util['mean'], '.0f') + '%'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--lmdb", help="read this packed LMDB instead of generating and packing a corpus")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, help="end each case after this long (warm-up included)")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--size", type=int, default=224, help="the crop's side (160: the frontier's faster step)")
    parser.add_argument("--cases", type=lambda v: v.split(","), default=list(CASES),
                        help=f"comma-separated, from {','.join(CASES + tuple(GPU_CASES))}")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        args.images, args.batch = min(args.images, 100), min(args.batch, 8)
        args.steps, args.warmup = min(args.steps, 6), 2
    packed = args.lmdb
    if packed is None:
        work = tempfile.mkdtemp(prefix="feed-bench-")
        make_corpus(os.path.join(work, "src"), classes=100, per_class=max(1, args.images // 100),
                    workers=os.cpu_count() or 1)
        packed = pack(os.path.join(work, "src"), "lmdb", os.path.join(work, "data.lmdb"), progress=False).out
    unknown = sorted(set(args.cases) - set(CASES) - set(GPU_CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(CASES + tuple(GPU_CASES))}")
    out = feed_check(packed, device, args.batch, args.steps, args.warmup, args.workers, args.max_seconds,
                     model_name=args.model, size=args.size, cases=args.cases)
    out["env"]["images"] = args.images if args.lmdb is None else None
    print(json.dumps(out["env"]))
    print(table(out["results"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
