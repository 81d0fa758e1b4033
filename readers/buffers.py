"""Where a batch's memory lives, and the batch of encoded images.

allocate: a new batch buffer, in shared memory in a DataLoader worker (so handing it to
the main process copies nothing) or pinned in the main process when asked (so the copy
to the GPU can be asynchronous).

EncodedBatch: a batch's encoded images (JPEG bytes) end to end in one such buffer, with
their offsets: what make_loader's workers hand over for gpu_decode. Its layout, for any
reader: `data` is a 1-D uint8 tensor, `offsets` a 1-D int64 tensor of len(batch) + 1
entries, from 0 to data's length, and image i is data[offsets[i]:offsets[i + 1]].

WorkerBatch: a worker's batch on its way to the GPU, whose shared memory is given back as
soon as it is pinned (give_back), so that freeing it does not hold the GIL.
"""
from __future__ import annotations

import collections.abc
import threading

import numpy as np
import torch
import torch.utils.data
from torch.utils.data._utils.pin_memory import pin_memory as pin_structure

from packer.formats import MADV_REMOVE, advise_pages


_shared_here = False  # set by share_batches(): this process hands its batches to another
_arena = threading.local()  # .take: where this thread's batch goes (readers.ring), or None


def set_arena(take) -> None:
    """Allocate this thread's batches with take(shape, dtype) from now on (None: stop); a
    None from it falls back to allocate's own memory (readers.ring: a slot that is full)."""
    _arena.take = take


def share_batches() -> None:
    """Allocate batches in shared memory in this process from now on, as in a DataLoader
    worker (readers.threads' background process)."""
    global _shared_here
    _shared_here = True


def allocate(shape, dtype, pin_memory: bool = False) -> torch.Tensor:
    """A new uninitialised tensor: shared in a DataLoader worker (or after share_batches());
    pinned in the main process when pin_memory is set and CUDA is available; in this
    thread's arena where one is set (set_arena)."""
    take = getattr(_arena, "take", None)
    if take is not None:
        out = take(shape, dtype)
        if out is not None:
            return out
    if _shared_here or torch.utils.data.get_worker_info() is not None:
        # Sending a tensor to the main process moves it to shared memory (a copy), so
        # allocate it there. torch's default_collate does the same through this private
        # call; share_memory_() is the public fallback, slower by a copy of the batch.
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
        if new_shared is None:
            return torch.empty(shape, dtype=dtype).share_memory_()
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return torch.empty(0, dtype=dtype).set_(new_shared(nbytes)).view(shape)
    pin = pin_memory and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


class EncodedBatch:
    """A batch of encoded images (a raw dataset's bytes) in one uint8 tensor (the layout above).

    Made in a DataLoader worker (readers.collate.encoded_collate), it is in shared memory,
    so the main process receives it without copying the bytes (a list of bytes is pickled
    through a pipe and rebuilt there: here, 26 ms of the main process's time per batch of
    256 against 7), and it is pinned in one piece. readers.nvjpeg.GPUDecoder decodes it.
    """

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, keys: list | None = None):
        self.data, self.offsets = data, offsets
        self.keys = keys  # each image's sample key (readers.keyed), or None: unkeyed

    @classmethod
    def of(cls, blobs: list, pin_memory: bool = False, keys: list | None = None) -> "EncodedBatch":
        """The bytes-like objects in blobs, copied once into one new (shared or pinned) buffer."""
        arrays = [np.frombuffer(blob, dtype=np.uint8) for blob in blobs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        data = allocate((int(offsets[-1]),), torch.uint8, pin_memory)
        if arrays:
            np.concatenate(arrays, out=data.numpy())
        return cls(data, torch.from_numpy(offsets), keys)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sizes(self) -> list[int]:
        return self.offsets.diff().tolist()

    def tensors(self) -> list[torch.Tensor]:
        """Each image's bytes as a 1-D uint8 view of data (no copy)."""
        return list(torch.split(self.data, self.sizes()))

    def views(self) -> list[memoryview]:
        """Each image's bytes as a memoryview of data (no copy)."""
        whole = memoryview(self.data.numpy())
        edges = self.offsets.tolist()
        return [whole[start:end] for start, end in zip(edges, edges[1:])]

    def pin_memory(self) -> "EncodedBatch":
        """This batch with its bytes in pinned memory (DataLoader(pin_memory=True) calls this)."""
        return EncodedBatch(self.data.pin_memory(), self.offsets, self.keys)

    def __repr__(self) -> str:
        return f"EncodedBatch({len(self)} images, {self.data.numel()} bytes)"


class WorkerBatch:
    """A batch made by readers' own collate in a DataLoader worker, for a loader that pins
    (make_loader with a CUDA target). Every tensor in it is a buffer made for this batch
    alone, so once DataLoader's pin thread has copied it to pinned memory nothing reads
    the shared memory again: pin_memory() returns the pinned batch and gives those pages
    back at once (give_back), instead of leaving them to the munmap that frees them
    under the GIL. A second call returns the same pinned batch."""

    def __init__(self, batch):
        self.batch, self.pinned = batch, None

    def pin_memory(self, device=None):
        if self.pinned is None:
            self.pinned = pinned_then_given_back(self.batch, pin_structure)
            self.batch = None  # emptied: only the pinned batch may be read from now on
        return self.pinned

    def __repr__(self) -> str:
        return f"WorkerBatch({self.batch if self.pinned is None else self.pinned!r})"


def pinned_then_given_back(batch, pin):
    """pin(batch), then the shared pages of batch's tensors given back (give_back), but
    for any whose memory the pinned batch still reaches (pin returns a pinned tensor as it
    is, and EncodedBatch keeps its offsets): only for a batch whose every tensor is new."""
    pinned = pin(batch)
    kept = [extent(tensor) for tensor in tensors_in(pinned)]
    for tensor in tensors_in(batch):
        start, stop = extent(tensor)
        if not any(start < kept_stop and kept_start < stop for kept_start, kept_stop in kept):
            give_back(tensor)
    return pinned


def extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The address range of tensor's whole storage."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + max(storage.nbytes(), 1)


def tensors_in(batch):
    """Every strided tensor in batch (a sparse one has no one storage to give back): inside
    tuples, lists, mappings and EncodedBatch."""
    if isinstance(batch, torch.Tensor):
        if batch.layout == torch.strided:
            yield batch
    elif isinstance(batch, EncodedBatch):
        yield batch.data
        yield batch.offsets
    elif isinstance(batch, collections.abc.Mapping):
        for value in batch.values():
            yield from tensors_in(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from tensors_in(value)


# Freeing a worker's batch falls to the last process to unmap it (the worker has dropped
# it by then): 6-15 ms for 256 images of 224x224 here, in one munmap, which holds the GIL
# (tensor deallocation does), so the training thread cannot launch its kernels meanwhile.
# madvise(MADV_REMOVE) frees the same pages of a shared-memory mapping with the GIL
# released; the munmap then finds nothing left to free.
def give_back(tensor: torch.Tensor) -> bool:
    """Free the pages of tensor's shared-memory storage now, the GIL released. The storage
    stays mapped and reads as zeros after: only for a buffer nothing will read again.
    False, and nothing done, where the storage is not shared memory (a storage mapped from
    a file is shared too, but giving its pages back would punch holes in the file) or the
    system cannot."""
    storage = tensor.untyped_storage()
    if storage.device.type != "cpu" or not storage.is_shared() or getattr(storage, "filename", "") is not None:
        return False
    return advise_pages(storage.data_ptr(), storage.nbytes(), MADV_REMOVE)
