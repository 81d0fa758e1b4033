"""The ring of shared-memory batch slots between a thread-worker process and its trainer.

readers.threads' background process collates each batch straight into one slot of a ring
that both processes map, and the trainer's batch tensors are views of that slot: no copy,
no shared-memory segment made or mapped per batch, no file descriptor passed per batch.

- The ring is one memfd (Linux's anonymous shared memory), made by the trainer before it
  starts the process and mapped by both. It has no name in /dev/shm, so it cannot be left
  behind: the kernel frees it when the last process that maps it exits, SIGKILL included.
  Its size is virtual (`slots` x SLOT_BYTES): only the pages a batch has written are
  memory, and reusing the slots keeps those the same pages from batch to batch.
- A slot's lifetime: taken by a thread as it collates a batch (packer's collates allocate
  through readers.buffers.allocate, which the thread points at the slot), sent, then the
  trainer's until no tensor of that batch is alive in the trainer (checked at each batch
  the trainer takes); then it goes back to the process. A batch kept longer (appended to a
  list) just keeps its slot: meanwhile the process collates into fresh shared memory
  (torch's, as before), so no batch is ever overwritten under its holder. A batch bigger
  than a slot, or a collate_fn of one's own, goes that way too.
- Pinning is a copy: where the loader pins (CUDA), the trainer copies each batch from its
  slot into pinned memory from torch's caching host allocator, which reuses a block only
  once its copy to the GPU has finished, and gives the slot back at once. A registered
  ring (cudaHostRegister) would save that copy, but its slots would have to be fenced
  against the prefetcher's asynchronous copies by hand. Without CUDA nothing is pinned.

On the way over a batch is pickled with its ring tensors as (offset, dtype, shape,
stride) references into its slot and its other tensors of up to INLINE_BYTES (labels) as
their bytes; bigger ones go as torch shares them (its file-descriptor strategy).
"""
from __future__ import annotations

import io
import mmap
import os
import pickle
import threading
from multiprocessing import reduction

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import buffers

SLOT_BYTES = 1 << 28  # 256 MiB virtual a slot: a batch of 256 float 3x224x224 images (154 MB) fits
ALIGN = 64  # bytes: every tensor in a slot starts on a cache line (any dtype's alignment)
INLINE_BYTES = 1 << 16  # a small tensor travels as its bytes (cheaper than sharing a descriptor)


class Ring:
    """`slots` slots of SLOT_BYTES in one shared mapping (the memfd `fd`, new if None)."""

    def __init__(self, slots: int, fd: int | None = None):
        if fd is None:
            fd = os.memfd_create("packer-batches", 0)  # inherited by a forked child: no CLOEXEC
            os.ftruncate(fd, slots * SLOT_BYTES)
        self.slots, self.fd = slots, fd
        self.map = mmap.mmap(fd, slots * SLOT_BYTES)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)  # the process's view: one storage
        self.address = self.base.data_ptr()

    def __reduce__(self):  # to a spawned process: the memfd passed along, then mapped there
        return attach, (self.slots, reduction.DupFd(self.fd))

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory lies in this ring."""
        return self.address <= t.data_ptr() < self.address + self.slots * SLOT_BYTES

    def close(self) -> None:
        os.close(self.fd)  # the mappings stay until their tensors go

    # The process's side: collate into a slot.
    def arena(self, slot: int) -> "Arena":
        return Arena(self.base, slot * SLOT_BYTES, (slot + 1) * SLOT_BYTES)

    def reference(self, t: torch.Tensor):
        """A ring tensor's (offset in the ring, dtype, shape, stride), or None for another tensor."""
        if t.device.type != "cpu" or t.untyped_storage().data_ptr() != self.address:
            return None
        return t.storage_offset() * t.element_size(), str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride()

    # The trainer's side: a batch's tensors as views of its slot.
    def slot_storage(self, slot: int) -> torch.UntypedStorage:
        """A storage of its own over `slot`: alive as long as a tensor of the batch is."""
        view = memoryview(self.map)[slot * SLOT_BYTES:(slot + 1) * SLOT_BYTES]
        return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


def attach(slots: int, fd) -> Ring:
    return Ring(slots, fd.detach())


class Arena:
    """Bump allocation in one slot, for readers.buffers.allocate: None once it is full."""

    def __init__(self, base: torch.Tensor, start: int, end: int):
        self.base, self.start, self.at, self.end = base, start, start, end

    def take(self, shape, dtype) -> torch.Tensor | None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for n in shape:
            count *= int(n)
        at = -(-self.at // ALIGN) * ALIGN
        if at + count * itemsize > self.end:
            return None
        self.at = at + count * itemsize
        return self.base[at:self.at].view(dtype).view(tuple(shape))

    @property
    def used(self) -> int:
        return self.at - self.start


class Slots:
    """The process's free slots, shared by its threads."""

    def __init__(self, slots: int):
        self.free, self.lock = list(range(slots)), threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        with self.lock:
            self.free.append(slot)


def collate_into(ring: Ring, slots: Slots, collate_fn, samples: list) -> tuple[int, object]:
    """(slot, batch): `samples` collated into a free slot of the ring, or (-1, batch) in
    fresh memory when no slot is free or nothing of the batch landed in one."""
    slot = slots.take()
    if slot is None:
        return -1, collate_fn(samples)
    arena = ring.arena(slot)
    buffers.set_arena(arena.take)
    try:
        batch = collate_fn(samples)
    except BaseException:
        slots.give(slot)
        raise
    finally:
        buffers.set_arena(None)
    if not arena.used:
        slots.give(slot)
        return -1, batch
    return slot, batch


class _Packer(reduction.ForkingPickler):
    def __init__(self, file, ring: Ring, slot: int):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.ring, self.slot = ring, slot

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        found = self.ring.reference(obj) if self.slot >= 0 else None
        if found is not None:
            offset, *rest = found
            return ("slot", offset - self.slot * SLOT_BYTES, *rest)
        if obj.device.type == "cpu" and not obj.requires_grad and obj.numel() * obj.element_size() <= INLINE_BYTES:
            flat = obj.detach().contiguous().reshape(-1).view(torch.uint8)
            return ("bytes", flat.numpy().tobytes(), str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return None


def pack(batch, ring: Ring, slot: int) -> bytes:
    """The batch as bytes to send: its tensors in `slot` as references (-1: no slot)."""
    out = io.BytesIO()
    _Packer(out, ring, slot).dump(batch)
    return out.getvalue()


class _Unpacker(pickle.Unpickler):
    def __init__(self, file, storage):
        super().__init__(file)
        self.storage = storage

    def persistent_load(self, pid):
        if pid[0] == "bytes":
            _, data, dtype, shape = pid
            if not data:
                return torch.empty(shape, dtype=getattr(torch, dtype))
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
        _, offset, dtype, shape, stride = pid
        dtype = getattr(torch, dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.storage is None or offset % itemsize:
            raise pickle.UnpicklingError("a batch refers to a ring slot it was not sent in")
        return torch.empty(0, dtype=dtype).set_(self.storage, offset // itemsize, shape, stride)


class Taken:
    """The trainer's side of the slots: the batches handed out, each until it is dropped."""

    def __init__(self, ring: Ring):
        self.ring, self.held = ring, []  # [(slot, weak reference to its batch's storage)]

    def unpack(self, data: bytes, slot: int):
        """The batch sent as `data` in `slot` (-1: none), its ring tensors views of the slot."""
        storage = self.ring.slot_storage(slot) if slot >= 0 else None
        batch = _Unpacker(io.BytesIO(data), storage).load()
        if storage is not None:
            self.held.append((slot, StorageWeakRef(storage)))
        return batch

    def dropped(self) -> list[int]:
        """The slots of batches no tensor of which is alive any more: free for the process."""
        free = [slot for slot, ref in self.held if ref.expired()]
        if free:
            self.held = [(slot, ref) for slot, ref in self.held if not ref.expired()]
        return free
