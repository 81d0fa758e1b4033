"""A batch written into its ring slot sample by sample (readers.slot_fill): the same bytes
readers.collate makes (uint8, normalised, channels_last, narrower floats, numpy images,
(image, label, source) triples), in the ring, whatever the order and threads the samples
come in; anything else collated whole; a sample of another shape named. Through
worker_kind="threads": a thread holds at most a chunk of samples, not a whole batch, and
a failing sample still names its index."""
from __future__ import annotations

import functools
import random
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.utils.data as tud

from readers import make_loader
from readers.collate import Normalise, collate
from readers.ring import Ring, Slots
from readers.slot_fill import SlotFill
from readers.threads import FILL_CHUNK

BATCH = 12


def samples(kind: str, n: int = BATCH) -> list:
    g = torch.Generator().manual_seed(7)
    images = [torch.randint(0, 256, (3, 6, 5), generator=g, dtype=torch.uint8) for _ in range(n)]
    if kind == "numpy":
        return [(image.numpy().copy(), i) for i, image in enumerate(images)]
    if kind == "triple":
        return [(image, i, i % 3) for i, image in enumerate(images)]
    if kind == "strided":  # views, not contiguous: copied as stack copies them
        return [(image.transpose(1, 2), i) for i, image in enumerate(images)]
    return [(image, i) for i, image in enumerate(images)]


def filled(collate_fn, batch: list, ring: Ring, threads: int = 3):
    """collate_fn's batch through a SlotFill, its rows put in a shuffled order by `threads` threads."""
    fill = SlotFill(len(batch), collate_fn, ring, Slots(ring.slots))
    rows = list(range(len(batch)))
    random.Random(1).shuffle(rows)
    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(lambda part: [fill.put(r, batch[r]) for r in part], rows[t::threads])
                     for t in range(threads)]:
            done.result()
    return fill.result()


@pytest.fixture(scope="module")
def ring():
    made = Ring(2)
    yield made
    made.close()


@pytest.mark.parametrize("kind", ["tensor", "numpy", "triple", "strided"])
@pytest.mark.parametrize("normalise", [None, Normalise(), Normalise((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)),
                                       Normalise(dtype=torch.bfloat16, channels_last=True)],
                         ids=["uint8", "scaled", "mean-std", "bf16-channels-last"])
def test_a_batch_filled_sample_by_sample_is_the_batch_collate_makes(ring, kind, normalise):
    batch = samples(kind)
    collate_fn = functools.partial(collate, pin_memory=False, normalise=normalise)
    slot, out = filled(collate_fn, batch, ring)
    want = collate_fn(batch)
    assert slot >= 0 and ring.holds(out[0])
    assert len(out) == len(want)
    for got, expected in zip(out, want):
        assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
        assert torch.equal(got, expected)


def test_other_samples_and_collates_are_collated_whole(ring):
    as_dicts = [{"x": torch.full((2,), i)} for i in range(BATCH)]
    slot, out = filled(collate, as_dicts, ring)
    assert torch.equal(out["x"], collate(as_dicts)["x"])
    assert filled(summed, samples("tensor"), ring)[1] == summed(samples("tensor"))


def summed(batch: list) -> int:
    return sum(int(image.sum()) for image, _ in batch)


def test_a_sample_of_another_size_is_named(ring):
    batch = samples("tensor")
    batch[7] = (torch.zeros((3, 4, 4), dtype=torch.uint8), 7)
    fill = SlotFill(len(batch), collate, ring, Slots(ring.slots))
    for row in range(7):
        fill.put(row, batch[row])
    with pytest.raises(ValueError, match=r"sample 7 is \(3, 4, 4\) torch.uint8 but sample 0 is \(3, 6, 5\)"):
        fill.put(7, batch[7])
    fill.give_back()
    assert sorted(fill.slots.free) == [0, 1]


class Counted(tud.Dataset):
    """224x224-sized samples whose label is how many of the samples made so far in this
    process are still alive: how many a thread worker holds at once."""

    def __init__(self, n: int, bad: int = -1, odd: int = -1):
        self.n, self.bad, self.odd, self.made, self.lock = n, bad, odd, [], None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        if index == self.bad:
            raise ValueError("not a JPEG")
        if self.lock is None:
            self.lock = threading.Lock()
        image = torch.full((3, 32, 32) if index != self.odd else (3, 16, 16), index % 251, dtype=torch.uint8)
        with self.lock:
            self.made = [ref for ref in self.made if ref() is not None]
            self.made.append(weakref.ref(image))
            alive = len(self.made)
        return image, alive

    def __getstate__(self) -> dict:
        return {**self.__dict__, "made": [], "lock": None}


def test_a_thread_worker_holds_a_chunk_of_samples_not_a_whole_batch():
    batch, threads = 4 * FILL_CHUNK, 2
    made = make_loader(Counted(6 * batch), batch, workers=threads, train=False, worker_kind="threads")
    batches = list(made)
    assert [int(images[:, 0, 0, 0].sum()) for images, _ in batches] == \
        [sum(i % 251 for i in range(b * batch, (b + 1) * batch)) for b in range(6)]
    # each thread holds the chunk it reads and the last sample of the one before
    assert max(int(alive.max()) for _, alive in batches) <= threads * (FILL_CHUNK + 1)


@pytest.mark.parametrize("bad", [3, 2 * FILL_CHUNK + 5])  # in the first batch (read by both threads) or a later one
def test_a_failing_sample_written_into_its_slot_still_names_its_index(bad):
    made = make_loader(Counted(8 * FILL_CHUNK, bad=bad), 2 * FILL_CHUNK, workers=2, train=False,
                       worker_kind="threads")
    with pytest.raises(RuntimeError, match=rf"sample {bad} of Counted failed: ValueError: not a JPEG"):
        list(made)


def test_a_sample_of_another_size_names_its_index_through_the_background_process():
    odd = 2 * FILL_CHUNK + 2  # the second batch's: read by one thread, its sample 0 first
    made = make_loader(Counted(4 * FILL_CHUNK, odd=odd), 2 * FILL_CHUNK, workers=2, train=False,
                       worker_kind="threads")
    with pytest.raises(RuntimeError, match=rf"collating sample {odd} into its batch failed: ValueError"):
        list(made)
