"""WDSDataset's streams on sample numbers alone: the runs of shards a DataLoader worker
reads (Task, stream_sizes), the samples a DataLoader has taken from each worker
(consumed_samples), and what a worker's shuffle buffer holds (replay_shuffle). Resuming,
on the same ranks or others (readers.wds_elastic), works these out without reading data.
"""
from __future__ import annotations

import random
from typing import NamedTuple


class Task(NamedTuple):
    """A run of one shard's samples: from start to stop (None: to its end)."""

    shard: int
    start: int = 0
    stop: int | None = None


def replay_shuffle(n: int, size: int, rng: random.Random, skip: int) -> tuple[list[int], int, bool]:
    """shuffled() over n items, replayed on their ordinals until `skip` are out: (slots, the
    buffer as ordinals; inputs consumed; drained: the input had ended and the buffer was
    shuffled, so slots are what is left to yield, in order), with rng where shuffled's is."""
    slots = list(range(min(size, n)))
    consumed, out = len(slots), 0
    # rng.randrange(size), inlined: CPython's draw for it (getrandbits of size's bit length
    # until below size) at a third of the cost; a resume replays up to an epoch of draws.
    bits, draw = size.bit_length(), rng.getrandbits
    while out < skip and consumed < n:
        j = draw(bits)
        while j >= size:
            j = draw(bits)
        slots[j] = consumed
        consumed += 1
        out += 1
    if out == skip:
        return slots, consumed, False
    rng.shuffle(slots)
    return slots[skip - out:], n, True


def stream_sizes(total: int, workers: int) -> list[int]:
    """Samples each of a rank's `workers` DataLoader workers reads of its `total`: equal to
    within one, the first ones one more."""
    return [total // workers + (w < total % workers) for w in range(workers)]


def consumed_samples(sizes: list[int], batches: int, batch_size: int, drop_last: bool) -> tuple[list[int], int]:
    """(samples each worker has yielded, the worker whose batch comes next) once a
    DataLoader over an IterableDataset has handed out `batches` batches: it takes one batch
    from each worker in turn, skipping workers with none left (each batches its own
    stream; drop_last drops each one's partial batch)."""
    left = [n // batch_size + (0 if drop_last or n % batch_size == 0 else 1) for n in sizes]
    taken = [0] * len(sizes)
    remaining, following = batches, 0
    while remaining and any(left):
        for w in range(len(sizes)):
            if left[w] and remaining:
                left[w] -= 1
                taken[w] += 1
                remaining -= 1
                following = (w + 1) % len(sizes)
    if remaining:
        raise ValueError(f"WDSDataset: the state has {batches} batches read, more than this epoch's "
                         f"{batches - remaining}; it was saved over other data")
    return [min(t * batch_size, n) for t, n in zip(taken, sizes)], following


def cut(dataset, pool: list, begin: int, end: int) -> list:
    """The pool's samples [begin, end), as tasks."""
    tasks, first = [], 0
    for task in pool:
        if first >= end:  # the rest of the pool lies past the cut (a share's padding is its start)
            break
        size = dataset.task_size(task)
        low, high = max(begin, first), min(end, first + size)
        if low < high:
            tasks.append(Task(task.shard, task.start + low - first, task.start + high - first))
        first += size
    return tasks
