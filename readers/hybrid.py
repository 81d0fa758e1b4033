"""Hybrid decode: each batch split between the DataLoader workers (CPU) and the JPEG engines, the split tuned online.

make_loader(gpu_decode="hybrid") decodes the first images of every batch in the workers
(the transform applied to the bytes, as decode="raw" with a transform does) and hands the
rest over undecoded for the engine (readers.nvjpeg.GPUDecoder); the main process decodes
that part and puts the two together, in sample order. Both sides run at once. DALI
splits by a fixed ratio;
here SplitTuner moves the CPU's share f after every batch towards the f at which both
sides finish together,

    f* = cpu_rate / (cpu_rate + engine_rate),

from the per-image costs each side measures: the workers time their own decoding (so
their rate is `workers` over the seconds an image takes one worker), the main process
times the engine's part. Costs per image do not depend on f, so the workers' batches read
ahead under an older f do not bias the estimate. Each side keeps at least one image of
every batch, so both rates stay measured and neither side is starved.

The workers read f from one float64 in shared memory (SharedFraction), set by the main
process: a fork inherits the mapping, a spawn receives it through torch's tensor sharing.
"""
from __future__ import annotations

import functools
import math
import time

import torch

from .buffers import EncodedBatch, allocate
from .collate import collate_labels, encoded_collate, to_be_pinned
from .keyed import call_keyed
from .transforms import BYTES_TYPES


SHARE = "the share of each batch the CPU workers decode"


def checked_share(value, what: str, meaning: str = SHARE) -> float:
    """value as a float in [0, 1], or ValueError naming `what` and what it means."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be a number in [0, 1] ({meaning}), not {value!r}")
    return float(value)


class SplitTuner:
    """The CPU's share f of each batch, moved towards f* = cpu_rate / (cpu_rate + engine_rate).

    Args:
        start: f before anything is measured.
        smoothing: weight of a new measurement in the per-image costs' moving averages
            (1: the last batch alone).
        max_step: the most f moves per batch (0: a fixed split, as DALI's).
        low, high: bounds on f.
    """

    def __init__(self, start: float = 0.5, smoothing: float = 0.25, max_step: float = 0.1,
                 low: float = 0.0, high: float = 1.0):
        self.low, self.high = checked_share(low, "SplitTuner: low"), checked_share(high, "SplitTuner: high")
        if self.low > self.high:
            raise ValueError(f"SplitTuner: low ({low}) must not exceed high ({high})")
        self.fraction = min(self.high, max(self.low, checked_share(start, "SplitTuner: start")))
        if not 0.0 < checked_share(smoothing, "SplitTuner: smoothing", "the weight of each new measurement"):
            raise ValueError("SplitTuner: smoothing must be above 0 (it is the weight of each new measurement)")
        self.smoothing = float(smoothing)
        self.max_step = checked_share(max_step, "SplitTuner: max_step", "the most f moves per batch")
        self.cpu_cost: float | None = None  # seconds of one worker per image
        self.engine_cost: float | None = None  # seconds of the engine per image
        self.workers = 1

    def observe(self, cpu_images: int, cpu_seconds: float, engine_images: int, engine_seconds: float,
                workers: int) -> float:
        """Takes one batch's measurements (a side with 0 images is not measured); returns the new f."""
        for name, count in (("cpu_images", cpu_images), ("engine_images", engine_images), ("workers", workers)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"SplitTuner.observe: {name} must be an int >= 0, not {count!r}")
        for name, seconds in (("cpu_seconds", cpu_seconds), ("engine_seconds", engine_seconds)):
            if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
                raise ValueError(f"SplitTuner.observe: {name} must be a finite number of seconds >= 0, not "
                                 f"{seconds!r}; a clock reading went wrong")
        self.workers = max(1, workers)
        if cpu_images:
            self.cpu_cost = self._averaged(self.cpu_cost, cpu_seconds / cpu_images)
        if engine_images:
            self.engine_cost = self._averaged(self.engine_cost, engine_seconds / engine_images)
        target = self.target()
        if target is not None:
            step = max(-self.max_step, min(self.max_step, target - self.fraction))
            self.fraction = min(self.high, max(self.low, self.fraction + step))
        return self.fraction

    def _averaged(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.smoothing * (value - mean)

    @property
    def cpu_rate(self) -> float | None:
        """Images/s of all the workers together, or None before they are measured."""
        return None if self.cpu_cost is None else self.workers / max(self.cpu_cost, 1e-9)

    @property
    def engine_rate(self) -> float | None:
        return None if self.engine_cost is None else 1.0 / max(self.engine_cost, 1e-9)

    def target(self) -> float | None:
        """f* from the rates measured so far, or None until both sides are measured."""
        cpu, engine = self.cpu_rate, self.engine_rate
        return None if cpu is None or engine is None else cpu / (cpu + engine)

    def __repr__(self) -> str:
        return f"SplitTuner(fraction={self.fraction:.3f}, cpu_rate={self.cpu_rate}, engine_rate={self.engine_rate})"


class SharedFraction:
    """One float in shared memory: the main process sets f, the workers read it."""

    def __init__(self, value: float):
        self._cell = torch.tensor([checked_share(value, "SharedFraction")], dtype=torch.float64).share_memory_()

    def get(self) -> float:
        return float(self._cell[0])

    def set(self, value: float) -> None:
        self._cell[0] = checked_share(value, "SharedFraction.set")


def split_count(fraction: float, n: int) -> int:
    """How many of a batch's n images the workers decode: ceil(f n), leaving each side at
    least one image of a batch of two or more (so both rates stay measured)."""
    k = math.ceil(checked_share(fraction, "split_count: fraction") * n)
    return min(max(k, 1), n - 1) if n >= 2 else k


class SplitBatch(EncodedBatch):
    """An EncodedBatch of the images left to the engine, plus `decoded`, the uint8 KxCxHxW
    images the workers decoded (the batch's first K), and the worker-seconds they took."""

    def __init__(self, decoded: torch.Tensor, data: torch.Tensor, offsets: torch.Tensor, cpu_seconds: float,
                 keys: list | None = None):
        super().__init__(data, offsets, keys)
        self.decoded, self.cpu_seconds = decoded, cpu_seconds

    def pin_memory(self) -> "SplitBatch":
        return SplitBatch(self.decoded.pin_memory(), self.data.pin_memory(), self.offsets, self.cpu_seconds,
                          self.keys)

    def __repr__(self) -> str:
        return f"SplitBatch({len(self.decoded)} decoded, {len(self)} encoded images)"


class HybridCollate:
    """The workers' collate: (SplitBatch, labels) from (bytes, label) pairs, the first
    split_count(f, n) images decoded through `transform`. Pickles (spawned workers)."""

    def __init__(self, transform, share: SharedFraction, pin_memory: bool = False):
        self.transform, self.share, self.pin_memory = transform, share, pin_memory

    def __call__(self, batch):
        if not batch or not isinstance(batch[0], (tuple, list)) or len(batch[0]) != 2 \
                or not isinstance(batch[0][0], BYTES_TYPES):
            return encoded_collate(batch, self.pin_memory)
        k = split_count(self.share.get(), len(batch))
        keys = getattr(batch, "keys", None) or [None] * len(batch)  # readers._dataset.KeyedSamples'
        started = time.perf_counter()
        images = [call_keyed(key, self.transform, sample[0]) for key, sample in zip(keys, batch[:k])]
        decoded = (torch.stack(images, out=allocate((k, *images[0].shape), torch.uint8, self.pin_memory))
                   if images else torch.empty((0, 3, 1, 1), dtype=torch.uint8))
        seconds = time.perf_counter() - started
        rest = EncodedBatch.of([sample[0] for sample in batch[k:]], self.pin_memory)
        return SplitBatch(decoded, rest.data, rest.offsets, seconds, keys[k:]), collate_labels(batch)


class HybridDecoder:
    """make_loader's gpu_decode for a hybrid split: SplitBatch -> uint8 NxCxHxW on the engine's device.

    engine: encoded images -> uint8 batch (readers.nvjpeg.GPUDecoder, or any callable of
    that form); transform: what the workers apply to bytes (default: the engine's
    `transform`); workers: how many decode (make_loader sets it).
    """

    def __init__(self, engine, tuner: SplitTuner | None = None, transform=None, workers: int = 1):
        self.engine = engine
        self.transform = transform if transform is not None else getattr(engine, "transform", None)
        if self.transform is None:
            raise ValueError("HybridDecoder: the workers need the transform the engine applies; pass transform=")
        self.tuner = tuner if tuner is not None else SplitTuner()
        self.share = SharedFraction(self.tuner.fraction)
        self.workers = workers

    def collate(self, pin_memory: bool = False) -> HybridCollate:
        return HybridCollate(self.transform, self.share, pin_memory)

    def __call__(self, batch: SplitBatch) -> torch.Tensor:
        if not isinstance(batch, SplitBatch):
            raise TypeError(f"HybridDecoder takes the SplitBatch its collate makes, not {type(batch).__name__}; "
                            "build the loader with make_loader(gpu_decode='hybrid') or collate_fn=decoder.collate()")
        started = time.perf_counter()
        parts = []
        if len(batch):
            parts.append(self.engine(EncodedBatch(batch.data, batch.offsets, batch.keys)))
            if parts[0].is_cuda:  # the engine's kernels are queued: time them, not their launches
                torch.cuda.current_stream(parts[0].device).synchronize()
        seconds = time.perf_counter() - started
        if len(batch.decoded):
            device = parts[0].device if parts else getattr(self.engine, "device", "cpu")
            parts.insert(0, batch.decoded.to(device, non_blocking=True))
        self.share.set(self.tuner.observe(len(batch.decoded), batch.cpu_seconds, len(batch), seconds, self.workers))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def __repr__(self) -> str:
        return f"HybridDecoder({self.engine!r}, {self.tuner!r})"


def hybrid_collate(decoder, workers: int, pin_memory: bool, collate_fn=None):
    """make_loader's collate for a HybridDecoder (None for any other decoder); it needs workers,
    and is the collate: the workers' decoding happens in it."""
    if not isinstance(decoder, HybridDecoder):
        return None
    if collate_fn is not None:
        raise ValueError("make_loader: gpu_decode='hybrid' decodes the workers' share in its own collate; drop "
                         "collate_fn (or use gpu_decode=True)")
    if workers < 1:
        raise ValueError("make_loader: gpu_decode='hybrid' splits each batch with the DataLoader workers; "
                         "with workers=0 there are none: set workers >= 1, or use gpu_decode=True")
    decoder.workers = workers
    collate_fn = decoder.collate()
    return functools.partial(to_be_pinned, collate_fn) if pin_memory else collate_fn  # see batch_collate's give_back
