"""WDSDataset's streams on sample numbers alone: the runs of shards a DataLoader worker
reads (Task, stream_sizes), the samples a DataLoader has taken from each worker
(consumed_samples), and what a worker's shuffle buffer holds (replay_shuffle). Resuming,
on the same ranks or others (readers.wds_elastic), works these out without reading data.
"""
from __future__ import annotations

import bisect
import itertools
import random
from typing import NamedTuple

import numpy as np

CHUNK = 1 << 16  # draws made at a time: memory flat whatever the epoch's size
MANY_DRAWS = 1 << 12  # from here on, numpy makes the draws: its fixed cost is what about 3,000 cost in Python


class Task(NamedTuple):
    """A run of one shard's samples: from start to stop (None: to its end)."""

    shard: int
    start: int = 0
    stop: int | None = None


def replay_shuffle(n: int, size: int, rng: random.Random, skip: int) -> tuple[list[int], int, bool]:
    """shuffled() over n items, replayed on their ordinals until `skip` are out: (slots, the
    buffer as ordinals; inputs consumed; drained: the input had ended and the buffer was
    shuffled, so slots are what is left to yield, in order), with rng where shuffled's is."""
    slots = np.arange(min(size, n), dtype=np.int64)
    consumed = len(slots)
    out = min(skip, n - consumed)  # a draw for each input past the buffer's first, until `skip` are out
    draws(rng, size, out, slots, consumed)
    consumed += out
    if out == skip:
        return slots.tolist(), consumed, False
    slots = slots.tolist()
    rng.shuffle(slots)
    return slots[skip - out:], n, True


def draws(rng: random.Random, size: int, count: int, slots: np.ndarray, first: int) -> None:
    """Make `count` of shuffled()'s draws, rng.randrange(size) each, and put input ordinals
    first, first + 1, ... into the slots drawn, as it does (the last put into a slot stays);
    rng ends where those draws leave it."""
    bits = size.bit_length()
    if count < MANY_DRAWS or bits > 32:  # few (or each several words, a buffer over 2**32 samples)
        # rng.randrange(size), inlined: CPython's draw for it (getrandbits of size's bit length
        # until below size) at a third of the cost.
        draw = rng.getrandbits
        for ordinal in range(first, first + count):
            j = draw(bits)
            while j >= size:
                j = draw(bits)
            slots[j] = ordinal
        return
    many_draws(rng, size, bits, count, slots, first)


def many_draws(rng: random.Random, size: int, bits: int, count: int, slots: np.ndarray, first: int) -> None:
    """draws() without a Python loop over them: getrandbits(bits <= 32) is the top bits of one
    Mersenne Twister word, and numpy's MT19937 makes the same words from rng's state, `count`
    at a time (never one past the last needed: each accepted draw needs one). A resume
    replays up to an epoch of draws."""
    version, words, gauss = rng.getstate()
    twister = np.random.MT19937(0)
    twister.state = {"bit_generator": "MT19937", "state": {"key": np.array(words[:-1], np.uint32), "pos": words[-1]}}
    while count:
        drawn = twister.random_raw(min(count, CHUNK)) >> np.uint64(32 - bits)
        drawn = drawn[drawn < size].astype(np.int64)
        # Ordinals only grow, so the last put into a slot is the largest (slots start below first).
        np.maximum.at(slots, drawn, np.arange(first, first + len(drawn), dtype=np.int64))
        first += len(drawn)
        count -= len(drawn)
    state = twister.state["state"]
    rng.setstate((version, tuple(state["key"].tolist()) + (int(state["pos"]),), gauss))


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
    """The pool's samples [begin, end), as tasks (each stop given). The tasks wholly inside
    are found by bisection and kept as they are: a resumed pass's pool holds a task per
    sample its saved shuffle buffers held, and each worker cuts its run out of it."""
    ends = list(itertools.accumulate(map(dataset.task_size, pool)))  # each task's end in the pool
    low, high = bisect.bisect_right(ends, begin), bisect.bisect_left(ends, end)
    tasks = []
    for k in range(low, min(high + 1, len(pool))):
        task, first = pool[k], ends[k] - dataset.task_size(pool[k])
        start, stop = max(begin, first), min(end, ends[k])
        if start >= stop:
            continue
        if task.stop is None or start > first or stop < ends[k]:
            task = Task(task.shard, task.start + start - first, task.start + stop - first)
        tasks.append(task)
    return tasks
