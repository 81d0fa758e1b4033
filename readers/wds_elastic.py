"""The rest of a WDSDataset epoch after passes on other ranks and workers: an elastic stream resume.

A stream has no one global order to count into, as the samplers have: each DataLoader
worker of each rank reads its own run of shards through its own shuffle buffer, so the
order depends on the number of ranks and workers. To resume on another number, each
saving pass, a segment {"world_size", "workers", "batches", "batch_size", "drop_last"},
is replayed on sample numbers alone, stream by stream, as a same-world resume replays its
own stream (wds.replay_shuffle): which samples each stream had yielded to a batch handed
out. The samples no stream had yielded, in the epoch's shard order, are the rest. It is
cut into equal contiguous shares for the new ranks (padded with at most world_size - 1
repeats of its first samples), each share into one run per worker, and each run streams
through the worker's shuffle buffer. A state saved during such a pass lists the segments
before it ("history"), so resuming again replays them all: the state stays a few
numbers per resume, and loading costs one replay of the samples consumed.

A DataLoader worker's own state (torchdata's StatefulDataLoader) holds its own stream's
count alone: its pass is the segment {"world_size", "workers", "streams"}, every stream's
count, which the rank's new workers pool (readers._pool) as they start, each with its own.
"""
from __future__ import annotations

import math
import random

import numpy as np

from ._stream import Task, consumed_samples, cut, replay_shuffle

SEGMENT_KEYS = ("world_size", "workers", "batches", "batch_size", "drop_last")  # a loader's pass (its batches)
STREAMS_KEYS = ("world_size", "workers", "streams")  # a pass of StatefulDataLoader's workers (each stream's count)


def checked_history(history, kind: str = "WDSDataset") -> list[dict]:
    """A position's "history": a list of segments, each checked."""
    if not isinstance(history, list):
        raise ValueError(f"{kind}.load_state_dict: history must be a list of passes, got {history!r}")
    for segment in history:
        if not (isinstance(segment, dict) and valid_segment(segment)):
            raise ValueError(f"{kind}.load_state_dict: each pass of the history needs the ints "
                             f"{', '.join(SEGMENT_KEYS[:-1])} (>= 1; batches >= 0) and drop_last, or world_size, "
                             f"workers and streams (a count >= 0 per worker), got {segment!r}")
    return [{**segment, "streams": list(segment["streams"])} if "streams" in segment else dict(segment)
            for segment in history]


def valid_segment(segment: dict) -> bool:
    if set(segment) == set(STREAMS_KEYS):
        streams = segment["streams"]
        return (all(type(segment[key]) is int and segment[key] >= 1 for key in STREAMS_KEYS[:2])
                and isinstance(streams, list) and len(streams) == segment["workers"]
                and all(type(n) is int and n >= 0 for n in streams))
    if set(segment) != set(SEGMENT_KEYS):
        return False
    counts = all(type(segment[key]) is int and segment[key] >= (key != "batches") for key in SEGMENT_KEYS[:-1])
    return counts and type(segment["drop_last"]) is bool


def offsets(dataset) -> np.ndarray:
    """Each shard's first sample number: samples are numbered shard by shard, in list order."""
    return np.concatenate([[0], np.cumsum(dataset.shard_counts())]).astype(np.int64)


def shard_order(dataset) -> list[int]:
    """The epoch's shard order, as WDSDataset.plan deals it."""
    order = list(range(len(dataset.shards)))
    if dataset.shuffle:
        order = np.random.default_rng([dataset.seed, dataset.epoch]).permutation(len(order)).tolist()
    return order


def numbers(dataset, tasks, first: np.ndarray) -> np.ndarray:
    """The sample numbers of the tasks' samples, in order."""
    runs = [first[t.shard] + np.arange(t.start, t.start + dataset.task_size(t), dtype=np.int64) for t in tasks]
    return np.concatenate(runs) if runs else np.zeros(0, np.int64)


def rank_plan(dataset, rank: int, world_size: int, history: list[dict]) -> list:
    """This rank's tasks in a pass after `history`: the epoch's own plan when there is none."""
    if not history:
        return dataset.plan(rank, world_size)
    return share(dataset, rest(dataset, history), rank, world_size)


def rest(dataset, history: list[dict]) -> list:
    """The samples no stream of the history's passes yielded, as tasks in the epoch's shard order."""
    first = offsets(dataset)
    taken = np.zeros(int(first[-1]), dtype=bool)
    pool = None  # what the pass being replayed dealt: None, the epoch's own plan
    for segment in history:
        world_size = segment["world_size"]
        for rank in range(world_size):
            plan = dataset.plan(rank, world_size) if pool is None else share(dataset, pool, rank, world_size)
            mark_consumed(dataset, plan, rank, segment, first, taken)
        pool = untaken(dataset, taken, first)
    return pool


def untaken(dataset, taken: np.ndarray, first: np.ndarray) -> list:
    """The samples not marked in `taken`, as runs in the epoch's shard order."""
    tasks = []
    counts = dataset.shard_counts()
    for shard in shard_order(dataset):
        left = ~taken[first[shard]:first[shard] + counts[shard]]
        edges = np.flatnonzero(np.diff(np.concatenate([[False], left, [False]]).astype(np.int8)))
        tasks.extend(Task(shard, int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))
    return tasks


def mark_consumed(dataset, plan: list, rank: int, segment: dict, first: np.ndarray, taken: np.ndarray) -> None:
    """Mark in `taken` the samples this rank's streams had yielded to the segment's batches."""
    workers = segment["workers"]
    sizes = dataset.run_sizes(plan, workers)
    if "streams" in segment:
        yielded = segment["streams"]
        if any(n > size for n, size in zip(yielded, sizes)):
            raise ValueError(f"WDSDataset: the state has {yielded} samples read from the streams of a pass whose "
                             f"streams hold {sizes}; it was saved over other data")
    else:
        yielded, _ = consumed_samples(sizes, segment["batches"], segment["batch_size"], segment["drop_last"])
    for stream_id in range(workers):
        ordinals = np.zeros(sizes[stream_id], dtype=bool)
        rng = stream_rng(dataset, rank, stream_id)
        if rng is None:
            ordinals[:yielded[stream_id]] = True
        else:
            slots, read, _ = replay_shuffle(sizes[stream_id], dataset.shuffle, rng, yielded[stream_id])
            ordinals[:read] = True
            ordinals[slots] = False  # still in the buffer: read, not yet yielded
        taken[numbers(dataset, dataset.worker_tasks(plan, stream_id, workers), first)[ordinals]] = True


def stream_rng(dataset, rank: int, stream_id: int) -> random.Random | None:
    """The shuffle buffer's generator of a stream, as WDSDataset.stream seeds it."""
    if dataset.shuffle <= 1:
        return None
    seed = np.random.SeedSequence([dataset.seed, dataset.epoch, rank, stream_id]).generate_state(1)[0]
    return random.Random(int(seed))


def share(dataset, pool: list, rank: int, world_size: int) -> list:
    """This rank's contiguous, equal share of the pool's samples; the last ranks' shortfall
    (world_size - 1 samples at most in all) repeats the pool's first samples."""
    total = sum(map(dataset.task_size, pool))
    each = math.ceil(total / world_size)
    begin, end = min(total, rank * each), min(total, (rank + 1) * each)
    tasks = cut(dataset, pool, begin, end)
    return tasks + cut(dataset, pool, 0, each - (end - begin))


def segment_of(position: dict, world_size: int) -> dict:
    """A loader position's pass (readers.make_loader's: the rank's batches), as a history segment."""
    return {"world_size": world_size, "workers": position["workers"], "batches": position["batches"],
            "batch_size": position["batch_size"], "drop_last": position["drop_last"]}


def continue_or_deal(position: dict | None, saved_world: int, world_size: int, workers: int, pool=None
                     ) -> tuple[list[dict], dict | None]:
    """(the history of the pass a state resumes, the position to skip to in it, or None to
    start it afresh): the saved pass goes on where its ranks and workers are this run's,
    else it ends, and the rest is dealt anew.

    pool(position): every stream's count of the rank, from a worker's own position
    (StatefulDataLoader's) of a rank with several, pooled with its peers' as they start
    (readers._pool); None where no peers pool here (the main process)."""
    if position is None:
        return [], None
    history = position.get("history", [])
    if saved_world == world_size and position["workers"] == workers:
        return history, position
    if "samples" not in position:
        return history + [segment_of(position, saved_world)], None
    if position["workers"] == 1:  # the rank's one stream: this count is every rank's
        streams = [position["samples"]]
    elif pool is None or position["workers"] != workers:
        raise ValueError(unpooled_message(position, saved_world, world_size, workers))
    else:  # every rank's stream w has yielded as many samples (equal shares, equal batch counts)
        streams = pool(position)
    if not (any(streams) or history):  # nothing consumed: the epoch as a run on this world reads it
        return [], None
    return history + [{"world_size": saved_world, "workers": len(streams), "streams": streams}], None


def unpooled_message(position: dict, saved_world: int, world_size: int, workers: int) -> str:
    """Why one DataLoader worker's state (torchdata's StatefulDataLoader) of several cannot
    resume here, and what can."""
    return (f"WDSDataset: this state is one DataLoader worker's of {position['workers']} (torchdata's "
            f"StatefulDataLoader hands each worker its own), saved on {saved_world} rank(s); here there are "
            f"{world_size} rank(s) with {workers} worker(s). On other ranks, the rank's position is every worker's "
            f"count together, which the {position['workers']} workers of a StatefulDataLoader pool as they start: "
            f"load the whole loader state into StatefulDataLoader(num_workers={position['workers']}) (for another "
            "number, rewrite it with readers.for_workers first), or resume through readers.make_loader's loader (its "
            "state holds the rank's batches)")
