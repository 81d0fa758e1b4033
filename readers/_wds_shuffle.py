"""The shuffle stage of a WDSDataset's stream: a worker's samples through its shuffle buffer,
whose draws are fixed by (seed, epoch, rank, worker), and the same stream resumed after its
first samples by replaying those draws on sample ordinals alone (readers._stream.replay_shuffle),
so only the shards still holding buffered samples, or samples from the resume point on, are
read again."""
from __future__ import annotations

import random
from typing import Iterable, Iterator

import numpy as np

from ._stream import Task, replay_shuffle
from ._wds_read import read_ordinals, read_tasks


def stream_rng(shuffle: int, seed: int, epoch: int, rank: int, worker_id: int) -> random.Random | None:
    """The draws of a worker's shuffle buffer; None without one (a buffer of 0 or 1 keeps the order)."""
    if shuffle <= 1:
        return None
    return random.Random(int(np.random.SeedSequence([seed, epoch, rank, worker_id]).generate_state(1)[0]))


def samples_after(ds, tasks: list[Task], skip: int, rng: random.Random | None) -> Iterator:
    """The tasks' samples in the order this worker yields them (through the shuffle buffer
    when rng is given), less the first `skip`."""
    if not skip:
        samples = read_tasks(ds, tasks)
        return samples if rng is None else shuffled(samples, ds.shuffle, rng)
    sizes = [ds.task_size(t) for t in tasks]
    if rng is None:
        return (sample for _, sample in read_ordinals(ds, tasks, sizes, skip, ()))
    slots, consumed, drained = replay_shuffle(sum(sizes), ds.shuffle, rng, skip)
    source = read_ordinals(ds, tasks, sizes, consumed, slots)
    return resumed_shuffle(source, slots, drained, ds.shuffle, rng)


def shuffled(items: Iterable, size: int, rng: random.Random, buffer: list | None = None) -> Iterator:
    """A shuffle buffer: keep `size` items, yield a random one as each new one arrives.
    buffer: the items already held (a resumed stream's)."""
    buffer = [] if buffer is None else buffer
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer


def resumed_shuffle(source: Iterator[tuple[int, tuple]], slots: list[int], drained: bool, size: int,
                    rng: random.Random) -> Iterator:
    """shuffled()'s output from a replayed state on: source yields (ordinal, sample) in
    order, first every ordinal in slots (all read before the stop), then the unread rest."""
    found: dict[int, tuple] = {}
    while len(found) < len(slots):
        ordinal, sample = next(source)
        found[ordinal] = sample
    buffer = [found[ordinal] for ordinal in slots]
    if drained:
        return iter(buffer)
    return shuffled((sample for _, sample in source), size, rng, buffer)
