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
A pass whose ranks' streams read different counts (a stream mixture's chains,
readers._mix_chains) is the segment {"world_size", "workers", "ranks"}: each rank's count
per stream.
"""
from __future__ import annotations

import math
import random
from typing import Iterator

import numpy as np

from ._state_limits import MAX_HISTORY, MAX_WORKERS, MAX_WORLD_SIZE, shown
from ._stream import Task, consumed_samples, cut, replay_shuffle, stream_sizes

SEGMENT_KEYS = ("world_size", "workers", "batches", "batch_size", "drop_last")  # a loader's pass (its batches)
STREAMS_KEYS = ("world_size", "workers", "streams")  # a pass of StatefulDataLoader's workers (each stream's count)
RANKS_KEYS = ("world_size", "workers", "ranks")  # a pass whose ranks read different counts (each rank's streams')


def checked_history(history, kind: str = "WDSDataset") -> list[dict]:
    """A position's "history": a list of at most MAX_HISTORY segments, each checked."""
    if not isinstance(history, list):
        raise ValueError(f"{kind}.load_state_dict: history must be a list of passes, got {shown(history)}")
    if len(history) > MAX_HISTORY:
        raise ValueError(f"{kind}.load_state_dict: the history holds {len(history)} passes, over the {MAX_HISTORY} "
                         "a state may hold (docs/resume.md): it is damaged or was not saved by state_dict()")
    for segment in history:
        if not (isinstance(segment, dict) and valid_segment(segment)):
            raise ValueError(f"{kind}.load_state_dict: each pass of the history needs the ints "
                             f"{', '.join(SEGMENT_KEYS[:-1])} (>= 1; batches >= 0) and drop_last, or world_size, "
                             f"workers and streams (a count >= 0 per worker), or world_size, workers and ranks (such "
                             f"a list per rank), with world_size at most "
                             f"{MAX_WORLD_SIZE} and workers at most {MAX_WORKERS}, got {shown(segment)}")
    return [copied_segment(segment) for segment in history]


def copied_segment(segment: dict) -> dict:
    if "ranks" in segment:
        return {**segment, "ranks": [list(row) for row in segment["ranks"]]}
    return {**segment, "streams": list(segment["streams"])} if "streams" in segment else dict(segment)


def valid_segment(segment: dict) -> bool:
    if not all(type(segment.get(key)) is int and 1 <= segment[key] <= most
               for key, most in (("world_size", MAX_WORLD_SIZE), ("workers", MAX_WORKERS))):
        return False
    if set(segment) == set(STREAMS_KEYS):
        return valid_counts(segment["streams"], segment["workers"])
    if set(segment) == set(RANKS_KEYS):
        return valid_ranks(segment)
    if set(segment) != set(SEGMENT_KEYS):
        return False
    counts = all(type(segment[key]) is int and segment[key] >= (key != "batches") for key in SEGMENT_KEYS[:-1])
    return counts and type(segment["drop_last"]) is bool


def valid_counts(streams, workers: int) -> bool:
    """Whether streams is a count >= 0 for each of `workers` streams."""
    return isinstance(streams, list) and len(streams) == workers and all(type(n) is int and n >= 0 for n in streams)


def valid_ranks(segment: dict) -> bool:
    """Whether a per-rank segment's "ranks" holds each rank's stream counts (checked after
    world_size and workers, so its length is bounded)."""
    ranks = segment["ranks"]
    return (isinstance(ranks, list) and len(ranks) == segment["world_size"]
            and all(valid_counts(row, segment["workers"]) for row in ranks))


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
    """The samples no stream of the history's passes yielded, as tasks in the epoch's shard
    order. Each pass is worked out as runs of the pool it dealt (its samples numbered in pool
    order), never a sample at a time: what each stream had yielded is a run from its start,
    less the samples still in its shuffle buffer where it stopped inside it, so a pass costs
    O(shards + ranks x workers x shuffle buffer) in memory, whatever the epoch's size, and
    its time is the replay of the buffers' draws. The streams of every rank are cut alike;
    every rank past the data's end has the same plan, marked once. Runs and tasks are
    worked on as numpy arrays: a resume's thousand one-sample runs cost no Python loop."""
    tasks = dataset.epoch_tasks()  # what the pass being replayed dealt: first the epoch's own samples
    if not history:
        return tasks
    pool = pool_of(dataset, tasks)
    for segment in history:
        total = int((pool[2] - pool[1]).sum())
        length = math.ceil(total / segment["world_size"])
        pool = without(pool, merged(*pass_runs(dataset, segment, total, length)))
    return list(map(Task._make, zip(*pool.tolist())))


def pool_of(dataset, tasks: list) -> np.ndarray:
    """The tasks as rows shard, start, stop of an int64 array (each stop given)."""
    rows = [(task.shard, task.start, task.start + dataset.task_size(task)) for task in tasks]
    return np.array(rows, np.int64).reshape(-1, 3).T


def pass_runs(dataset, segment: dict, total: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """[begin, end) runs (arrays of begins and ends) of the pool's sample numbers that the
    streams of the segment's pass had yielded to its batches, every rank's plan being
    `length` samples of a pool of `total`."""
    workers = segment["workers"]
    sizes = stream_sizes(length, workers)
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
    if "ranks" in segment:
        return ranks_runs(dataset, segment, total, length, sizes, edges)
    if "streams" in segment:
        yielded = segment["streams"]
        if any(n > size for n, size in zip(yielded, sizes)):
            raise ValueError(f"WDSDataset: the state has {shown(yielded)} samples read from the streams of a pass "
                             f"whose streams hold {shown(sizes)}; it was saved over other data")
    else:
        yielded, _ = consumed_samples(sizes, segment["batches"], segment["batch_size"], segment["drop_last"])
    return joined(yielded_runs(dataset, ranks, yielded, sizes, edges, begin, end)
                  for ranks, begin, end in share_spans(total, length, segment["world_size"]))


def yielded_runs(dataset, ranks, yielded: list[int], sizes: list[int], edges: list[int], begin: int, end: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Runs of the pool's sample numbers that the streams of `ranks` (one share of the
    pool, [begin, end) then its start) had yielded, `yielded` of each stream's `sizes`."""
    found = []
    for stream_id, (n, size) in enumerate(zip(yielded, sizes)):
        if not n:
            continue
        if dataset.shuffle <= 1 or n == size:  # yielded in order, or the buffer drained
            lows, highs = np.zeros(1, np.int64), np.full(1, n, np.int64)
        else:  # stopped inside its shuffle buffer: which samples depends on the rank's draws
            lows, highs = stream_yield(dataset, ranks, stream_id, size, n)
        found.append(pool_runs(lows + edges[stream_id], highs + edges[stream_id], begin, end))
    return joined(found)


def ranks_runs(dataset, segment: dict, total: int, length: int, sizes: list[int], edges: list[int]
               ) -> tuple[np.ndarray, np.ndarray]:
    """pass_runs of a per-rank segment: each rank's streams yielded their own counts, so
    each rank's runs are worked out on their own (the padding ranks' too, joined after)."""
    counts = segment["ranks"]
    if any(n > size for row in counts for n, size in zip(row, sizes)):
        raise ValueError(f"WDSDataset: the state has {shown(counts)} samples read from the streams of a pass whose "
                         f"streams hold {shown(sizes)} on each rank; it was saved over other data")
    return joined(yielded_runs(dataset, range(rank, rank + 1), counts[rank], sizes, edges, begin, end)
                  for ranks, begin, end in share_spans(total, length, segment["world_size"]) for rank in ranks)


def joined(runs) -> tuple[np.ndarray, np.ndarray]:
    """(begins, ends) of every (begins, ends) pair of runs, one after another."""
    runs = list(runs)
    if not runs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate([lows for lows, _ in runs]), np.concatenate([highs for _, highs in runs])


def share_spans(total: int, each: int, world_size: int) -> Iterator[tuple[range, int, int]]:
    """(ranks, begin, end) of each distinct share of share()'s deal of a pool of `total`:
    samples [begin, end) of the pool, then its first each - (end - begin) (the padding).
    Every rank past the pool's end has the same, its first samples."""
    within = min(world_size, math.ceil(total / each)) if each else 0
    for rank in range(within):
        yield range(rank, rank + 1), rank * each, min(total, (rank + 1) * each)
    if within < world_size:
        yield range(within, world_size), 0, 0


def pool_runs(lows: np.ndarray, highs: np.ndarray, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs [lows, highs) of a share's samples, the share being the pool's [begin, end) and
    then its start, as runs of the pool's sample numbers (a run across the two, split)."""
    mine = end - begin
    inside, past = lows < mine, highs > mine
    return (np.concatenate([begin + lows[inside], np.maximum(lows[past], mine) - mine]),
            np.concatenate([begin + np.minimum(highs[inside], mine), highs[past] - mine]))


def merged(lows: np.ndarray, highs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs sorted, overlapping and touching ones joined, empty ones left out."""
    full = lows < highs
    if not full.any():
        return lows[full], highs[full]
    order = np.lexsort((highs[full], lows[full]))
    lows, highs = lows[full][order], highs[full][order]
    reach = np.maximum.accumulate(highs)  # the end of the runs so far
    starts = np.flatnonzero(np.concatenate([[True], lows[1:] > reach[:-1]]))
    return lows[starts], reach[np.append(starts[1:], len(lows)) - 1]


def without(pool: np.ndarray, taken: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The pool (rows shard, start, stop) less the sample numbers in the sorted, disjoint
    runs `taken`: the runs between them, each cut where a task of the pool ends."""
    shards, starts, stops = pool
    ends = np.cumsum(stops - starts)  # each task's end in the pool's sample numbers
    firsts = ends - (stops - starts)
    total = int(ends[-1]) if len(ends) else 0
    lows = np.concatenate([[0], np.minimum(taken[1], total)]).astype(np.int64)
    highs = np.concatenate([np.minimum(taken[0], total), [total]]).astype(np.int64)
    free = lows < highs
    lows, highs = lows[free], highs[free]
    first = np.searchsorted(ends, lows, "right")  # the first task each free run reaches into
    count = np.searchsorted(firsts, highs, "left") - first  # and how many
    run = np.repeat(np.arange(len(lows)), count)
    task = first[run] + np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)
    low, high = np.maximum(lows[run], firsts[task]), np.minimum(highs[run], ends[task])
    kept = low < high
    task, low, high = task[kept], low[kept], high[kept]
    return np.stack([shards[task], starts[task] + low - firsts[task], starts[task] + high - firsts[task]])


def stream_yield(dataset, ranks, stream_id: int, size: int, yielded: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs (begins, ends) of the ordinals of a stream of `size` samples, stopped after
    `yielded` inside its shuffle buffer, that any of `ranks` had yielded: the samples read,
    less those still in the buffer of every rank (each rank's draws differ; the ranks share
    one plan, padding past the data's end). Once no sample is in every rank's buffer, the
    rest add none."""
    held = None
    read = 0
    for rank in ranks:
        slots, read, _ = replay_shuffle(size, dataset.shuffle, stream_rng(dataset, rank, stream_id), yielded)
        held = np.unique(slots) if held is None else np.intersect1d(held, slots)
        if not len(held):
            break
    held = held[held < read].astype(np.int64)
    lows, highs = np.concatenate([[0], held + 1]), np.concatenate([held, [read]])
    return lows[lows < highs], highs[lows < highs]


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
        return appended(history, segment_of(position, saved_world)), None
    if position["workers"] == 1:  # the rank's one stream: this count is every rank's
        streams = [position["samples"]]
    elif pool is None or position["workers"] != workers:
        raise ValueError(unpooled_message(position, saved_world, world_size, workers))
    else:  # every rank's stream w has yielded as many samples (equal shares, equal batch counts)
        streams = pool(position)
    if not (any(streams) or history):  # nothing consumed: the epoch as a run on this world reads it
        return [], None
    return appended(history, {"world_size": saved_world, "workers": len(streams), "streams": streams}), None


def appended(history: list[dict], segment: dict) -> list[dict]:
    """history with one more pass, within MAX_HISTORY: an epoch's passes on other ranks or
    workers are each replayed when it resumes, so their number bounds what a resume costs."""
    if len(history) >= MAX_HISTORY:
        raise ValueError(f"WDSDataset: this epoch has been resumed on other ranks or workers {len(history)} times, "
                         f"the most a state records ({MAX_HISTORY}, docs/resume.md): resume it on the "
                         f"{segment['world_size']} rank(s) with {segment['workers']} DataLoader worker(s) it was "
                         "saved on, which adds no pass, or start the next epoch")
    return history + [segment]


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
