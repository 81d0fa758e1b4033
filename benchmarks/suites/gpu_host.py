"""The host's share of GPU decode (make_loader(gpu_decode=...)), timed without a GPU.

    python benchmarks/suites/gpu_host.py PACK.lmdb [--batch 256] [--repeats 5] [--json out.json]

On a GPU the main process does three things per batch besides launching kernels: it
receives the batch's bytes from a worker, checks each header, and makes the 1-D uint8
tensors nvJPEG takes. This times those on the CPU, in interleaved rounds (medians):

  handover   main-process CPU time per batch from 2 DataLoader workers reading the pack
             at random: a list of bytes (readers.collate.collate, pickled through a pipe)
             against one shared buffer (readers.collate.encoded_collate, EncodedBatch)
  decoder    GPUDecoder's host time per image with the decode and the transform stubbed
             out (a fixed tiny image, no resize): given an EncodedBatch, and given a list
             of bytes; and, as the reference it replaced, one new bytearray per image
             turned into a tensor (what GPUDecoder did before EncodedBatch); it costs
             5x more in a fresh process, before malloc has freed a large block and
             stopped mapping each 100 KB copy afresh, so it is timed after the others
  transform  the host time per image of the transform GPUDecoder runs on the GPU,
             RandomResizedCrop(flip=0.5).batch, on a batch of tiny images (12x16, to 8x8)
             so that the kernels cost next to nothing: the crop draws, then the batch's
             windows resized at once (readers.resize); as the reference it replaced, the
             same draws with a float conversion and an F.interpolate per window; and the
             draws alone. On a GPU each op dispatched also costs a kernel launch. Also
             printed: the multiply-adds per image that readers.resize asks of a GPU for
             the batch's own image sizes, and how much its padding adds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from readers import LMDBDataset  # noqa: E402
from readers.buffers import EncodedBatch  # noqa: E402
from readers.collate import collate, encoded_collate  # noqa: E402
from readers.decode import MAX_PIXELS, checked_jpeg_size, image_size  # noqa: E402

TINY = torch.zeros(3, 8, 8, dtype=torch.uint8)


def stub_decode_jpeg(data, mode=None, device=None):
    return [TINY] * len(data) if isinstance(data, list) else TINY


def stubbed_decoder():
    """A GPUDecoder on the CPU whose decode returns a fixed tiny image: what is left is its host work."""
    fake = types.ModuleType("torchvision.io")
    fake.decode_jpeg, fake.ImageReadMode = stub_decode_jpeg, types.SimpleNamespace(RGB="RGB")
    saved = {name: sys.modules.get(name) for name in ("torchvision", "torchvision.io")}
    # The decoder imports torchvision.io when built; a stand-in, for the build only.
    sys.modules["torchvision"], sys.modules["torchvision.io"] = types.ModuleType("torchvision"), fake
    try:
        from readers.nvjpeg import GPUDecoder

        return GPUDecoder(lambda image: image, device="cpu")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def per_image_copies(blobs: list) -> list:
    """The reference: each header checked, each image copied into a new bytearray and wrapped."""
    for i, data in enumerate(blobs):
        checked_jpeg_size(data, f"image {i}", MAX_PIXELS)
    return [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in blobs]


def decoder_cases(blobs: list) -> dict:
    decoder, encoded = stubbed_decoder(), EncodedBatch.of(blobs)
    return {"decoder: EncodedBatch": lambda: decoder(encoded),
            "decoder: list of bytes": lambda: decoder(blobs),
            "reference: a bytearray per image": lambda: per_image_copies(blobs)}


def transform_cases(images: int) -> dict:
    from readers import RandomResizedCrop
    from readers.transforms import random_resized_crop_params

    crop = RandomResizedCrop(8, flip=0.5)
    tiny = [torch.zeros(3, 12, 16, dtype=torch.uint8) for _ in range(images)]

    def draws():
        for _ in range(images):
            random_resized_crop_params(375, 500, crop.scale, crop.ratio)

    return {"transform: RandomResizedCrop.batch, tiny images": lambda: crop.batch(tiny),
            "reference: window by window, tiny images": lambda: crop_window_by_window(crop, tiny),
            "transform: the crop draws alone (375x500)": draws}


def resize_work(blobs: list, size: int = 224) -> dict:
    """What readers.resize asks of a GPU for these images' own sizes: RandomResizedCrop(size)
    windows (seed 0) grouped as the batch would be; multiply-adds per image of its two
    matrix products, and the padded windows' elements over the windows' own."""
    from readers.resize import BUDGET, groups
    from readers.transforms import random_resized_crop_params

    generator = torch.Generator().manual_seed(0)
    windows = [random_resized_crop_params(*image_size(data), generator=generator) for data in blobs]
    found = groups(windows, 3, (size, size), BUDGET)
    macs = padded = 0
    for group in found:
        height, width = max(windows[i][2] for i in group), max(windows[i][3] for i in group)
        macs += len(group) * 3 * width * size * (height + size)  # out_h x H x 3W, then 3*out_h x W x out_w
        padded += len(group) * 3 * height * width
    own = sum(3 * h * w for _, _, h, w in windows)
    return {"multiply_adds_per_image": macs / len(blobs), "padded_over_own": padded / own, "groups": len(found)}


def crop_window_by_window(crop, images: list) -> torch.Tensor:
    """RandomResizedCrop.batch as it was before readers.resize: the same draws, then a float
    conversion and an F.interpolate per window; rounded and flipped once."""
    from readers.transforms import flip_some, resized_float, to_uint8

    floats, flips = [], []
    for image in images:
        (top, left, h, w), flip = crop.draw(*image.shape[-2:])
        flips.append(flip)
        floats.append(resized_float(image[:, top:top + h, left:left + w], crop.size))
    return flip_some(to_uint8(torch.cat(floats)), flips)


def time_per_image(fn, images: int) -> float:
    """Microseconds per image: the best of 3 runs of 5 calls."""
    return min(timeit.repeat(fn, number=5, repeat=3)) / 5 / images * 1e6


def handover_ms(pack: str, collate_fn, batch: int, batches: int) -> float:
    """Main-process CPU milliseconds per batch taken from 2 workers reading at random."""
    dataset = LMDBDataset(pack, decode="raw")
    draws = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=(batches + 3) * batch)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=draws, num_workers=2,
                                         collate_fn=collate_fn, prefetch_factor=4)
    it = iter(loader)
    for _ in range(3):  # workers started, queues full
        next(it)
    start = time.process_time()
    for _ in range(batches):
        next(it)
    spent = time.process_time() - start
    del it
    return spent / batches * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", help="an LMDB pack (packer pack ... --to lmdb)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=30, help="batches timed per handover run")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dataset = LMDBDataset(args.pack, decode="raw")
    blobs = [dataset.reader.read_image(i)[0] for i in range(min(args.batch, len(dataset)))]
    dataset.close()
    cases = {**transform_cases(len(blobs)), **decoder_cases(blobs)}
    handovers = {"handover: list of bytes": collate, "handover: EncodedBatch": encoded_collate}
    runs: dict[str, list[float]] = {name: [] for name in [*cases, *handovers]}
    for round_ in range(args.repeats):
        for name, fn in cases.items():
            runs[name].append(time_per_image(fn, len(blobs)))
        for name, collate_fn in handovers.items():
            runs[name].append(handover_ms(args.pack, collate_fn, args.batch, args.batches))
        print(f"round {round_ + 1}/{args.repeats}", file=sys.stderr)
    units = {name: "ms per batch (main process CPU)" if name.startswith("handover") else "us per image"
             for name in runs}
    result = {"batch": args.batch, "repeats": args.repeats,
              "cases": {name: {"median": statistics.median(v), "runs": v, "unit": units[name]}
                        for name, v in runs.items()}}
    result["resize_work"] = resize_work(blobs)
    for name, case in result["cases"].items():
        print(f"{name:36s} {case['median']:8.1f} {case['unit']}  (runs {', '.join(f'{v:.1f}' for v in case['runs'])})")
    work = result["resize_work"]
    print(f"readers.resize on these images at 224: {work['multiply_adds_per_image'] / 1e6:.0f} M multiply-adds "
          f"an image, padding x{work['padded_over_own']:.2f}, {work['groups']} group(s) per batch")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
