"""A batch written into its ring slot sample by sample, as the thread workers read them.

readers.threads' background process collates into a ring slot (readers.ring). Collating
a list of samples means a thread holds the whole batch of decoded, augmented images (64
of 3x224x224: 9.6 MB) in its malloc arena until the last one is read; each thread's arena
then keeps that much for good. A SlotFill instead takes the batch's place in a slot when
its first sample arrives and copies each sample into its row there at once, so a thread
holds one sample at a time. The bytes are those readers.collate's stack would write: the
same copy (or, with a Normalise, the same per-image normalize_into) into the same layout.

Only readers.collate's own batches are filled this way (make_loader's default collate_fn,
with or without its Normalise), and only when the first sample is an (image, label) or
(image, label, source) sample with a tensor or numpy image; anything else is kept and
handed to the collate_fn whole, as before.
"""
from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from . import buffers
from .collate import collate, label_tensor
from .ring import Ring, Slots, collate_into


def fill_options(collate_fn):
    """(True, normalise) when collate_fn is readers.collate's own (make_loader's default,
    never pinned in the background process), else (False, None): collate as a whole."""
    if isinstance(collate_fn, functools.partial) and collate_fn.func is collate and not collate_fn.args \
            and not collate_fn.keywords.get("pin_memory") and set(collate_fn.keywords) <= {"pin_memory", "normalise"}:
        return True, collate_fn.keywords.get("normalise")
    return collate_fn is collate, None


class SlotFill:
    """One batch of `size` samples: put(row, sample) from any thread, then result()."""

    def __init__(self, size: int, collate_fn, ring: Ring, slots: Slots):
        self.size, self.collate_fn, self.ring, self.slots = size, collate_fn, ring, slots
        self.filling, self.normalise = fill_options(collate_fn)
        self.lock = threading.Lock()
        self.first = None  # (row, shape, dtype) of the first sample put: what every other must match
        self.images = None  # the batch's image tensor, in the slot (or in fresh shared memory)
        self.slot, self.arity = -1, 0  # arity: 2 for (image, label) samples, 3 with a source
        self.labels, self.sources, self.kept = [None] * size, [None] * size, None

    def put(self, row: int, sample) -> None:
        if self.first is None:
            with self.lock:
                if self.first is None:
                    self.begin(row, sample)
        if self.kept is not None:
            self.kept[row] = sample
            return
        image = self.checked(row, sample)
        if self.normalise is None:
            self.images[row].copy_(image)
        else:
            self.normalise.put(self.images[row], image, self.scratch())
        self.labels[row] = sample[1]
        if len(sample) == 3:
            self.sources[row] = sample[2]

    def begin(self, row: int, sample) -> None:
        """At the first sample: fill, the batch's tensor placed in a slot, or keep whole."""
        fills = (self.filling and isinstance(sample, (tuple, list)) and len(sample) in (2, 3)
                 and isinstance(sample[0], (torch.Tensor, np.ndarray)))
        image = torch.as_tensor(sample[0]) if fills else None
        if fills and self.normalise is not None and not (image.dtype == torch.uint8 and image.ndim == 3):
            fills = False  # normalised after stacking, as collate does for such images
        if not fills:
            self.kept = [None] * self.size
        else:
            self.images = self.allocate(image.shape, image.dtype)
            self.arity = len(sample)
        self.first = (row, tuple(image.shape) if fills else None, image.dtype if fills else None)

    def allocate(self, shape, dtype) -> torch.Tensor:
        """The batch's tensor, in a free slot of the ring if there is one and it fits."""
        slot = self.slots.take()
        self.slot = -1 if slot is None else slot
        arena = self.ring.arena(self.slot) if self.slot >= 0 else None
        if arena is not None:
            buffers.set_arena(arena.take)
        try:
            if self.normalise is not None:
                return self.normalise.empty(self.size, shape)
            return buffers.allocate((self.size, *shape), dtype)
        finally:
            if arena is not None:
                buffers.set_arena(None)
                if not arena.used:
                    self.give_back()

    def checked(self, row: int, sample) -> torch.Tensor:
        first_row, shape, dtype = self.first
        if not isinstance(sample, (tuple, list)) or len(sample) != self.arity:
            raise ValueError(f"collate: sample {row} is not an (image, label{', source' * (self.arity == 3)}) "
                             f"sample like sample {first_row}")
        image = torch.as_tensor(sample[0])
        if tuple(image.shape) != shape or image.dtype != dtype:
            raise ValueError(
                f"collate: sample {row} is {tuple(image.shape)} {image.dtype} but sample {first_row} is "
                f"{shape} {dtype}; batch images must share one size: use a transform "
                f"with a fixed output size (readers.RandomResizedCrop / readers.ResizeCenterCrop)")
        return image

    def scratch(self):
        """A float32 image for a normalise to a narrower float (one per thread)."""
        if self.normalise.dtype == torch.float32:
            return None
        shape = self.first[1]
        if getattr(_scratch, "shape", None) != shape:
            _scratch.shape, _scratch.image = shape, torch.empty(shape, dtype=torch.float32)
        return _scratch.image

    def result(self, rows: int | None = None) -> tuple[int, object]:
        """(slot, batch): the batch of its first `rows` samples (all: None), as collate_fn
        would have made it; slot -1 outside the ring."""
        rows = self.size if rows is None else rows
        if self.kept is not None:
            return collate_into(self.ring, self.slots, self.collate_fn, self.kept[:rows])
        out = self.images[:rows], label_tensor(self.labels[:rows])
        if self.arity == 3:
            out = (*out, torch.tensor(self.sources[:rows], dtype=torch.int64))
        return self.slot, out

    def give_back(self) -> None:
        """The slot back to the free ones (the batch failed, or landed elsewhere)."""
        if self.slot >= 0:
            self.slots.give(self.slot)
            self.slot = -1


_scratch = threading.local()  # .image: this thread's float32 scratch image, of .shape
