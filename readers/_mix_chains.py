"""A stream mixture's chains (readers.mix_stream): each (rank, DataLoader worker)'s run of a
stream source, what it has read at any batch, and where that falls in the stream's epochs.

Counts: batch j of a pass is made by worker j mod K (from where the pass began), so the
stream draws of a worker's batches, worked out from the schedule alone (Walk), are its
chain's count. An anchor holds where a run began or was last loaded, with each chain's
count there: {"epoch", "start" (the pass's first position of the epoch), "batches" (of
the pass), "skipped" (the loader's batches before the pass), "world_size", "workers",
"chains" (None: every chain at 0), "bases"}.

Bases: a chain reads its stream's epochs one after the other, from its stream source's base
{"epoch", "histories"}: the epochs from base epoch on, the first len(histories) of them
the rest left by the passes of its history (readers.wds_elastic), then whole ones. A
resume on other ranks or workers, or with other weights, folds the saved chains into a
new base (folded): the epochs they were in, each with one more segment, the per-rank
kind {"world_size", "workers", "ranks"} naming what each saved chain had read of it. The
new chains, all at 0, read the rest of those epochs, then whole ones, so no sample of a
stream epoch is read twice before the whole epoch is. A state holds O(ranks x workers x
stream sources) numbers per segment, at most MAX_HISTORY segments of MAX_HISTORY epochs.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ._state_limits import MAX_EPOCH, MAX_HISTORY, MAX_WORKERS, MAX_WORLD_SIZE, bounded_int, shown
from ._stream import stream_sizes
from .wds_elastic import appended, checked_history, rest

CHUNK = 4096  # positions walked at a time when counting a chain's draws
MOST = 2 ** 62  # a count no run reaches: the bound for counts read from a state
BASE = {"epoch": 0, "histories": []}  # a stream read from its first epoch, whole
START = {"epoch": 0, "start": 0, "batches": 0, "skipped": 0, "world_size": None, "workers": None, "chains": None,
         "bases": {}}
ANCHOR_KEYS = set(START)


class Walk:
    """The stream draws of a schedule: `sampler` (a MixSampler laid out as the run was),
    `streams` (the stream sources' indexes in its schedule), on `world_size` ranks cut
    into batches of batch_size."""

    def __init__(self, sampler, streams: list[int], world_size: int, batch_size: int, drop_last: bool):
        self.sampler, self.streams, self.world_size = sampler, streams, world_size
        self.batch_size, self.drop_last = batch_size, drop_last

    def length(self, start: int) -> int:
        """Positions each rank takes in a pass from `start`."""
        return self.sampler.pass_length(self.world_size, start)

    def batches(self, start: int) -> int:
        n = self.length(start)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def drawn(self, rank: int, workers: int, epoch: int, start: int, begin: int, end: int, shift: int) -> np.ndarray:
        """[worker, stream source] stream draws in batches [begin, end) of the rank's pass of
        `epoch` from `start`, batch j made by worker (j - shift) mod workers."""
        out = np.zeros((workers, len(self.streams)), dtype=np.int64)
        size = self.batch_size
        stop = min(end * size, self.length(start))
        saved, self.sampler.epoch = self.sampler.epoch, epoch
        try:
            for first in range(begin * size, stop, CHUNK):
                sources, _ = self.sampler.drawn(start, rank, self.world_size, first, min(stop, first + CHUNK))
                makers = ((first + np.arange(len(sources))) // size - shift) % workers
                for k, s in enumerate(self.streams):
                    out[:, k] += np.bincount(makers[sources == s], minlength=workers)
        finally:
            self.sampler.epoch = saved
        return out


class Counts:
    """Every chain's count at any batch, from an anchor by a Walk (of the anchor's names'
    stream sources). A whole epoch after the anchor's lays its sources out on the positions
    as every other does (the schedule's interleave and deal depend on the position alone),
    so its draws per chain are worked out once and multiplied."""

    def __init__(self, anchor: dict, walk: Walk, names: list[str]):
        self.anchor, self.walk, self.names = anchor, walk, names
        self.whole: dict = {}  # (rank, workers) -> the chains' draws in a whole epoch after the anchor's

    def at(self, rank: int, workers: int, epoch: int, batches: int) -> np.ndarray:
        """[worker, stream source] counts of the rank's chains after `batches` batches of
        `epoch`'s pass (the anchor's pass, in its epoch)."""
        anchor = self.anchor
        if (epoch, batches) < (anchor["epoch"], anchor["batches"]):
            raise ValueError(f"Mix: epoch {epoch} batch {batches} comes before where this run's chains were "
                             f"loaded (epoch {anchor['epoch']}, batch {anchor['batches']}); a stream goes forwards")
        if epoch == anchor["epoch"]:
            return self.anchored(rank, workers) + self.walk.drawn(rank, workers, epoch, anchor["start"],
                                                                  anchor["batches"], batches, anchor["batches"])
        return self.epoch_start(rank, workers, epoch) + self.walk.drawn(rank, workers, epoch, 0, 0, batches, 0)

    def anchored(self, rank: int, workers: int) -> np.ndarray:
        chains = self.anchor["chains"]
        if chains is None:
            return np.zeros((workers, len(self.names)), dtype=np.int64)
        return np.array([chains[name][rank] for name in self.names], dtype=np.int64).T.reshape(workers, -1)

    def epoch_start(self, rank: int, workers: int, epoch: int) -> np.ndarray:
        """Counts at the start of `epoch` (after the anchor's): the anchor's pass's rest, then
        whole epochs."""
        anchor, walk = self.anchor, self.walk
        key = (rank, workers)
        if key not in self.whole:
            rest = walk.drawn(rank, workers, anchor["epoch"], anchor["start"], anchor["batches"],
                              walk.batches(anchor["start"]), anchor["batches"])
            whole = walk.drawn(rank, workers, anchor["epoch"] + 1, 0, 0, walk.batches(0), 0)
            self.whole[key] = (self.anchored(rank, workers) + rest, whole)
        after_anchor, whole = self.whole[key]
        return after_anchor + (epoch - anchor["epoch"] - 1) * whole


@contextlib.contextmanager
def at_epoch(stream, epoch: int):
    """The stream's pass epoch set to `epoch` for a while (its shard order and buffers'
    draws), the epoch shared with its workers left as it is."""
    saved, stream.resume.pass_epoch = stream.resume.pass_epoch, epoch
    try:
        yield stream
    finally:
        stream.resume.pass_epoch = saved


def rank_length(stream, epoch: int, history: list[dict], world_size: int) -> int:
    """Samples each of `world_size` ranks reads of the stream's `epoch` after its history's passes."""
    if not history:
        return math.ceil(sum(stream.shard_counts()) / world_size)
    with at_epoch(stream, epoch):
        return math.ceil(sum(map(stream.task_size, rest(stream, history))) / world_size)


class ChainEpochs:
    """The stream epochs a stream source's chains read from its base, on world_size ranks
    of `workers` workers: the base's rest epochs, then whole ones."""

    def __init__(self, stream, base: dict, world_size: int, workers: int):
        self.first, self.histories = base["epoch"], base["histories"]
        self.rests = [stream_sizes(rank_length(stream, self.first + k, history, world_size), workers)
                      for k, history in enumerate(self.histories)]
        self.whole = stream_sizes(rank_length(stream, 0, [], world_size), workers)

    def at(self, worker_id: int, count: int) -> tuple[int, int, int]:
        """(k: the chain is in epoch first + k, samples of it read, samples it reads of it)."""
        for k, sizes in enumerate(self.rests):
            if count < sizes[worker_id]:
                return k, count, sizes[worker_id]
            count -= sizes[worker_id]
        whole = self.whole[worker_id]
        if not whole:
            raise ValueError(f"Mix: a chain of {len(self.whole)} DataLoader workers' has no sample of its stream to "
                             "read (more workers than the rank has samples): the state was not saved over this data")
        k, offset = divmod(count, whole)
        return len(self.rests) + k, offset, whole

    def epoch(self, k: int) -> int:
        return self.first + k

    def history(self, k: int) -> list[dict]:
        return self.histories[k] if k < len(self.histories) else []

    def size(self, k: int, worker_id: int) -> int:
        return self.rests[k][worker_id] if k < len(self.rests) else self.whole[worker_id]


def folded(epochs: ChainEpochs, chains: list[list[int]], name: str) -> dict:
    """A new base for a stream source whose chains (counts per worker per rank, read from
    `epochs`' base) stopped where they are: the epochs they were in, each with a per-rank
    segment of what every chain had read of it (its whole share of an epoch it is past)."""
    world_size, workers = len(chains), len(chains[0])
    where = [[epochs.at(w, n) for w, n in enumerate(row)] for row in chains]
    ks = [k for row in where for k, _, _ in row]
    low, high = min(ks), max(ks)
    if high - low >= MAX_HISTORY:
        raise ValueError(f"Mix: stream source {name!r}'s chains are {high - low + 1} of its epochs apart, over the "
                         f"{MAX_HISTORY} a state may carry on other ranks or workers: resume on the {world_size} "
                         f"rank(s) with {workers} DataLoader worker(s) it was saved on")
    histories = []
    for k in range(low, high + 1):
        ranks = [[epochs.size(k, w) if at > k else offset if at == k else 0 for w, (at, offset, _) in enumerate(row)]
                 for row in where]
        history = epochs.history(k)
        if any(map(any, ranks)):
            history = appended(history, {"world_size": world_size, "workers": workers, "ranks": ranks})
        histories.append(history)
    while histories and not histories[-1]:
        histories.pop()  # whole epochs follow anyway
    return {"epoch": epochs.epoch(low), "histories": histories}


def checked_anchor(anchor, names: list[str]) -> dict:
    """A state's anchor (see the module's docstring), every number and size checked, for a
    mixture whose stream sources are `names`."""
    if not isinstance(anchor, dict) or set(anchor) != ANCHOR_KEYS:
        raise ValueError(f"MixStream.load_state_dict: anchor must be a dict of {', '.join(sorted(ANCHOR_KEYS))}, as "
                         f"state_dict() gives it, got {shown(anchor)}")
    who = "MixStream.load_state_dict: the anchor's"
    for key in ("epoch", "start", "batches", "skipped"):
        bounded_int(anchor[key], key, who, 0, MAX_EPOCH if key == "epoch" else MOST)
    out = {**anchor, "bases": checked_bases(anchor["bases"], names)}
    if anchor["chains"] is None:
        return out
    world_size = bounded_int(anchor["world_size"], "world_size", who, 1, MAX_WORLD_SIZE)
    workers = bounded_int(anchor["workers"], "workers", who, 1, MAX_WORKERS)
    chains = anchor["chains"]
    if not isinstance(chains, dict) or list(chains) != names or not all(
            isinstance(ranks, list) and len(ranks) == world_size and all(
                isinstance(row, list) and len(row) == workers and all(type(n) is int and 0 <= n <= MOST for n in row)
                for row in ranks) for ranks in chains.values()):
        raise ValueError(f"MixStream.load_state_dict: the anchor's chains must hold, for each stream source "
                         f"({', '.join(names)}), a count >= 0 per worker per rank, got {shown(chains)}")
    return {**out, "chains": {n: [list(row) for row in rows] for n, rows in chains.items()}}


def checked_bases(bases, names: list[str]) -> dict:
    """The anchor's bases: for some of the stream sources `names`, an epoch and at most
    MAX_HISTORY epochs' histories (readers.wds_elastic.checked_history each)."""
    if not isinstance(bases, dict) or not set(bases) <= set(names):
        raise ValueError(f"MixStream.load_state_dict: the anchor's bases must be a dict over the stream sources "
                         f"({', '.join(names)}), got {shown(bases)}")
    out = {}
    for name, base in bases.items():
        if not (isinstance(base, dict) and set(base) == set(BASE) and isinstance(base["histories"], list)
                and len(base["histories"]) <= MAX_HISTORY):
            raise ValueError(f"MixStream.load_state_dict: the base of stream source {name!r} must be a dict of epoch "
                             f"and histories (at most {MAX_HISTORY}), got {shown(base)}")
        bounded_int(base["epoch"], "epoch", f"MixStream.load_state_dict: the base of {name!r}'s", 0, MAX_EPOCH)
        out[name] = {"epoch": base["epoch"], "histories": [checked_history(h, "MixStream") for h in base["histories"]]}
    return out
