"""The ring of batch slots of worker_kind="threads" (readers.ring): batches are views of the
ring, its slots are reused pass after pass by one background process, a batch kept by the
trainer is never overwritten, a pass broken off leaves the next one whole, the epoch
set on the trainer's dataset reaches the process's copy, a spawned process maps the same
ring, and the process ends with its loader (one that died is replaced at the next pass)."""
from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.utils.data as tud

from readers import make_loader
from readers.ring import SLOT_BYTES

BATCH, THREADS, SAMPLES = 4, 2, 48


class Numbers(tud.Dataset):
    """(image, label) pairs whose pixels are index + 100 x the epoch set on the dataset."""

    def __init__(self, n: int = SAMPLES):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return torch.full((3, 5, 5), index + 100 * self.epoch, dtype=torch.int32), index


def expected(epoch: int) -> list[list[int]]:
    return [list(range(i, i + BATCH)) for i in range(0, SAMPLES, BATCH)]


def check(batches: list, epoch: int) -> None:
    assert [labels.tolist() for _, labels in batches] == expected(epoch)
    for images, labels in batches:
        assert torch.equal(images[:, 0, 0, 0], labels.int() + 100 * epoch)


def threads_loader(**options):
    return make_loader(Numbers(), BATCH, workers=THREADS, train=False, worker_kind="threads", **options)


def test_batches_view_the_ring_and_one_process_reuses_its_slots_pass_after_pass():
    made = threads_loader()
    before = set(multiprocessing.active_children())
    slots, pids = set(), set()
    for epoch in range(3):
        batches = []
        for images, labels in made:
            ring = made.background().ring
            assert ring.holds(images)  # the trainer's tensor is a view of the slot: no copy
            slots.add((images.data_ptr() - ring.address) // SLOT_BYTES)
            batches.append((images.clone(), labels))
        check(batches, epoch)
        pids |= {child.pid for child in set(multiprocessing.active_children()) - before}
    assert len(pids) == 1  # one process for the three passes
    assert len(slots) <= ring.slots  # and the same few slots, over and over
    process = made.background().process
    made.close_workers()
    assert not process.is_alive()


def test_batches_kept_by_the_trainer_are_never_overwritten():
    made = threads_loader()
    kept = list(made)  # more batches than slots, all alive at once
    assert len(kept) > made.background().ring.slots
    check(kept, 0)
    check(list(made), 1)  # the slots of a pass's kept batches come back when they go


@pytest.mark.parametrize("taken", [0, 1, 3])
def test_a_pass_broken_off_leaves_the_next_one_whole(taken):
    made = threads_loader()
    batches = iter(made)
    for _ in range(taken):
        next(batches)
    del batches  # its batches still in flight arrive during the next pass: dropped there
    made.set_epoch(1)
    check(list(made), 1)
    check(list(made), 2)


def test_a_spawned_process_maps_the_same_ring():
    """Spawn (the context once CUDA is initialised) passes the ring's memfd to the child."""
    made = threads_loader(multiprocessing_context="spawn")
    batches = []
    for images, labels in made:
        assert made.background().ring.holds(images)
        batches.append((images.clone(), labels))
    check(batches, 0)


def test_the_process_ends_with_its_loader_and_a_dead_one_is_replaced_at_the_next_pass():
    import gc
    import os
    import signal
    import time

    made = threads_loader()
    check(list(made), 0)
    first = made.background().process
    os.kill(first.pid, signal.SIGKILL)
    first.join(timeout=30)
    check(list(made), 1)  # between passes: a new process serves the next one
    second = made.background().process
    assert second.pid != first.pid and second.is_alive()
    del made
    gc.collect()
    deadline = time.monotonic() + 30
    while second.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not second.is_alive()
