"""Batches (image, label) samples into one uint8 image tensor and one label tensor.

The batch tensor is allocated once per batch, where it will be needed: in a DataLoader
worker, in shared memory (so handing it to the main process copies no pixels); in the
main process, in pinned memory when asked (so the host-to-device copy can be
asynchronous). One torch.stack(out=...) fills it in C++.

With a Normalise (readers.make_loader's for device="cpu") the batch is made as float
instead, normalised image by image as it is filled: in the workers, so the consumer
receives finished batches, and one image at a time, so each image's two passes (multiply
into the float buffer, add) stay in the CPU cache and no uint8 batch is made on the way.

For gpu_decode, encoded images are batched undecoded, their bytes end to end in one such
buffer (readers.buffers.EncodedBatch).

For a loader that pins, a worker's batch travels as a WorkerBatch, whose shared memory
DataLoader's pin thread gives back as soon as it has pinned it (readers.buffers).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import default_collate

from .buffers import EncodedBatch, WorkerBatch, allocate
from .gpu import is_image_batch, map_tensors, normalize, normalize_coefficients, normalize_into
from .transforms import BYTES_TYPES


class Normalise:
    """uint8 NxCxHxW image batches -> float (x / 255 - mean) / std, as readers.CUDAPrefetcher
    converts them (the same float32 operations: identical outputs), for batches made on the CPU.

    mean, std: per channel, in [0, 1] units; None: x / 255. dtype: the float dtype out;
    channels_last: batches in channels_last memory format. Pickles (spawned workers).
    """

    def __init__(self, mean=None, std=None, dtype=torch.float32, channels_last: bool = False):
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"Normalise: dtype must be a floating-point torch.dtype, not {dtype!r}")
        self.mean, self.std, self.dtype, self.channels_last = mean, std, dtype, bool(channels_last)
        lengths = [len(v) for v in (mean, std) if v is not None and not isinstance(v, (int, float))]
        normalize_coefficients(mean, std, max(lengths, default=3))  # refuse bad values now, not in a worker
        self._coefficients: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def coefficients(self, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        if channels not in self._coefficients:
            self._coefficients[channels] = normalize_coefficients(self.mean, self.std, channels)
        return self._coefficients[channels]

    def stack(self, images: list, pin_memory: bool = False) -> torch.Tensor:
        """Equal-shaped uint8 CxHxW images -> one new normalised NxCxHxW batch (shared
        memory in a worker), filled image by image."""
        out = self.empty(len(images), images[0].shape, pin_memory)
        scratch = None if self.dtype == torch.float32 else torch.empty(images[0].shape, dtype=torch.float32)
        for image, slot in zip(images, out):
            self.put(slot, image, scratch)
        return out

    def empty(self, n: int, shape, pin_memory: bool = False) -> torch.Tensor:
        """A new batch of n normalised CxHxW images (readers.buffers.allocate), in this dtype and layout."""
        c, h, w = shape
        if self.channels_last:  # NHWC storage seen as NCHW: channels_last strides
            return allocate((n, h, w, c), self.dtype, pin_memory).permute(0, 3, 1, 2)
        return allocate((n, c, h, w), self.dtype, pin_memory)

    def put(self, slot: torch.Tensor, image: torch.Tensor, scratch: torch.Tensor | None) -> None:
        """One uint8 image normalised into its place in a batch; scratch: a float32 CxHxW
        image when this dtype is not float32 (computed in float32, then rounded once, as
        normalize() does), else None."""
        scale, shift = self.coefficients(image.shape[0])
        if scratch is None:
            normalize_into(slot, image, scale, shift)
        else:
            normalize_into(scratch, image, scale, shift)
            slot.copy_(scratch)

    def batch(self, t):
        """t normalised if it is a uint8 image batch (NxCxHxW), else t."""
        if not isinstance(t, torch.Tensor) or not is_image_batch(t):
            return t
        scale, shift = self.coefficients(t.shape[1])
        return normalize(t, scale, shift, self.dtype, self.channels_last)

    def __repr__(self) -> str:
        return (f"Normalise(mean={self.mean}, std={self.std}, dtype={self.dtype}, "
                f"channels_last={self.channels_last})")


class NormalisedCollate:
    """A collate_fn whose image batches (every uint8 NxCxHxW tensor in what it returns) come
    out normalised: for a user's collate_fn, run in the worker like it."""

    def __init__(self, collate_fn, normalise: Normalise):
        self.collate_fn, self.normalise = collate_fn, normalise

    def __call__(self, batch):
        return map_tensors(self.collate_fn(batch), self.normalise.batch)


def to_be_pinned(collate_fn, batch) -> WorkerBatch:
    """collate_fn(batch) as a WorkerBatch: for one of these collates, in a worker of a loader
    that pins, whose every tensor is new (so its shared memory can be given back once pinned)."""
    return WorkerBatch(collate_fn(batch))


def encoded_collate(batch, pin_memory: bool = False):
    """(EncodedBatch, labels) from a list of (encoded image bytes, label) pairs; anything
    else goes to collate."""
    if not batch or not isinstance(batch[0], (tuple, list)) or len(batch[0]) != 2 \
            or not isinstance(batch[0][0], BYTES_TYPES):
        return collate(batch, pin_memory)
    keys = getattr(batch, "keys", None)  # readers._dataset.KeyedSamples': for the decoder's draws
    return EncodedBatch.of([sample[0] for sample in batch], pin_memory, keys), collate_labels(batch)


def collate(batch, pin_memory: bool = False, normalise: Normalise | None = None):
    """(images, labels) from a list of (image, label) pairs of equal-sized uint8 images;
    (images, labels, sources) from a readers.Mix's (image, label, source) triples.

    Images may be tensors or numpy arrays (stacked in the shape they have: CxHxW tensors
    give NxCxHxW). Any other sample structure goes to torch's default_collate.
    Pinning applies only in the main process and only when CUDA is available.
    normalise: image batches come out as its float batches instead of uint8.
    """
    if not batch or not isinstance(batch[0], (tuple, list)) or len(batch[0]) not in (2, 3):
        return default_collate(batch)
    first = batch[0][0]
    if not isinstance(first, (torch.Tensor, np.ndarray)):
        return default_collate(batch)
    images = [torch.as_tensor(sample[0]) for sample in batch]
    out = stack(images, pin_memory, normalise), collate_labels(batch)
    return out if len(batch[0]) == 2 else (*out, torch.tensor([sample[2] for sample in batch], dtype=torch.int64))


def collate_labels(batch) -> torch.Tensor:
    """The labels of (image, label) pairs: int64 when they are ints, else default_collate's."""
    return label_tensor([sample[1] for sample in batch])


def label_tensor(labels: list) -> torch.Tensor:
    """Labels as int64 when they are ints, else default_collate's."""
    if all(isinstance(label, int) for label in labels):
        return torch.tensor(labels, dtype=torch.int64)
    return default_collate(labels)


def stack(images: list, pin_memory: bool = False, normalise: Normalise | None = None) -> torch.Tensor:
    """Stack equal-shaped tensors into one new (shared or pinned) buffer; with normalise,
    uint8 image batches come out normalised."""
    shape, dtype = images[0].shape, images[0].dtype
    for i, image in enumerate(images):
        if image.shape != shape or image.dtype != dtype:
            raise ValueError(
                f"collate: sample {i} is {tuple(image.shape)} {image.dtype} but sample 0 is "
                f"{tuple(shape)} {dtype}; batch images must share one size: use a transform "
                f"with a fixed output size (readers.RandomResizedCrop / readers.ResizeCenterCrop)")
    if normalise is not None and dtype == torch.uint8 and len(shape) == 3:
        return normalise.stack(images, pin_memory)
    out = allocate((len(images), *shape), dtype, pin_memory)
    out = torch.stack(images, out=out)
    return out if normalise is None else normalise.batch(out)
