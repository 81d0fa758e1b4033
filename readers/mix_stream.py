"""Mixtures with WebDataset streams as sources: readers.Mix over a readers.WDSDataset is a
MixStream, an IterableDataset whose DataLoader workers make their rank's batches in turn.

The schedule is the map-style mixture's (readers.mix.MixSampler, order "random"): each
position of an epoch belongs to a source by the weights, a map-style source's draw is the
sample its passes put there, and a stream's draw is the next sample of a stream. A stream
cannot be indexed, so each (rank, DataLoader worker) reads its own chain of the stream: the
WDSDataset's stream of that rank and worker, epoch after epoch of the stream (its own
epochs, which carry on across the mixture's). A rank's positions are cut into batches, and
batch j of a pass is made by worker j mod K, which is the order a DataLoader takes batches
from its workers in: the batches handed out are a prefix of the rank's positions, as with
the map-style mixture, and each chain's count is the stream draws of its worker's batches,
computed from the schedule alone (chain_counts).

The resume state holds an anchor: where the run began or a state was loaded, with each
chain's count there. Every chain's count at any later batch follows from the anchor by the
schedule, so the state stays O(sources x ranks x workers) numbers.
"""
from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context

import numpy as np
import torch.distributed
import torch.utils.data

from ._stream import stream_sizes
from ._state_limits import MAX_EPOCH, shown
from .ranks import worker
from .sampler import STATE_VERSION, check_state, checked_count
from .wds import WDSDataset

CHUNK = 4096  # positions walked at a time when counting a chain's draws
START = {"epoch": 0, "batches": 0, "chains": None}  # the anchor of a run begun afresh: every chain at 0


def is_stream(dataset) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset)


class StreamSource(torch.utils.data.Dataset):
    """A WDSDataset as the map-style schedule sees it: its length is the stream's samples per
    epoch over all ranks, its classes the stream's; only its first sample is ever asked for
    (readers.Mix compares the sources' kinds of sample)."""

    def __init__(self, stream: WDSDataset):
        self.stream, self.classes = stream, stream.classes

    def __len__(self) -> int:
        return sum(self.stream.shard_counts())

    def __getitem__(self, index: int):
        if index != 0:
            raise IndexError("StreamSource: a stream is read in order, never by index")
        return next(iter(self.stream))


def stream_views(sources: dict) -> dict:
    """The sources with each WDSDataset as a StreamSource; any other IterableDataset refused."""
    for name, dataset in sources.items():
        if is_stream(dataset) and not isinstance(dataset, WDSDataset):
            raise ValueError(f"Mix: source {name!r} ({type(dataset).__name__}) is an IterableDataset other than "
                             "readers.WDSDataset; a mixture reads map-style datasets by index and WebDataset "
                             "streams: open it as a map-style Dataset, or its shards with readers.WDSDataset")
    return {name: StreamSource(ds) if isinstance(ds, WDSDataset) else ds for name, ds in sources.items()}


class Chain:
    """One stream source's chain in this (rank, worker): the WDSDataset's stream of them, epoch
    after epoch; `count` samples read over the run, `size` per epoch of the stream."""

    def __init__(self, stream: WDSDataset, size: int, count: int):
        self.stream, self.size, self.count, self.samples = stream, size, count, None

    def next(self):
        while True:
            if self.samples is None:
                self.samples = self.opened(self.count // self.size, self.count % self.size)
            sample = next(self.samples, None)
            if sample is not None:
                self.count += 1
                return sample
            # The epoch's run ended (short only where on_error="skip" left out a damaged shard).
            self.count, self.samples = (self.count // self.size + 1) * self.size, None

    def opened(self, epoch: int, offset: int):
        """The stream's epoch `epoch` from its `offset`-th sample: loaded as WDSDataset's own
        state, so the epoch shared with the main process is left as it is."""
        rank, world_size = self.stream.world()
        worker_id, workers = worker()
        position = {"rank": rank, "worker": worker_id, "workers": workers, "samples": offset} if offset else None
        self.stream.load_state_dict({**self.stream.stream_state(), "epoch": epoch, "position": position})
        return iter(self.stream)


class MixStream(torch.utils.data.IterableDataset):
    """readers.Mix with WebDataset streams among its sources (docs/mixing.md).

    Iterated in a DataLoader, worker w of K makes batches w, w + K, ... of its rank's
    positions: it must know the loader's batch size and drop_last (make_loader tells it;
    for a plain DataLoader call batching()). Each sample is (image, label, source).
    Resumes through make_loader's loader on the ranks, DataLoader workers and batch size
    the state was saved with.
    """

    def __init__(self, view, sampler, sources: dict):
        streams = {name: ds for name, ds in sources.items() if is_stream(ds)}
        if view.reweight:
            raise ValueError("Mix: reweight=True does not yet apply to a mixture with a WebDataset stream "
                             f"({', '.join(map(repr, streams))}): resume it with the weights it was saved with")
        self.view, self.sampler, self.names = view, sampler, view.names
        self.streams = {view.names.index(name): ds for name, ds in streams.items()}
        self.classes, self.class_to_idx, self.decode = view.classes, view.class_to_idx, view.decode
        self.batch_size, self.drop_last = None, False
        self.anchor = dict(START)
        self.pending: tuple[int, int] | None = None  # (epoch, batches) a loaded state's pass starts at
        self._epoch = multiprocessing.Value("q", 0, lock=False)  # shared with persistent workers
        self._walked: dict = {}  # (rank, workers) -> (an epoch, the chains' counts at its start)
        self._chains: dict = {}  # this process's chains, by source

    def batching(self, batch_size: int, drop_last: bool) -> None:
        """The loader's batch size and drop_last, which fix what each worker makes."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"Mix.batching: batch_size must be a positive int, got {batch_size!r}")
        self.batch_size, self.drop_last = batch_size, bool(drop_last)

    @property
    def epoch(self) -> int:
        return self._epoch if isinstance(self._epoch, int) else self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self._epoch, int):
            self._epoch = int(epoch)
        else:
            self._epoch.value = int(epoch)

    def world(self) -> tuple[int, int]:
        return self.sampler.world()

    def __len__(self) -> int:
        """Samples this rank reads per epoch (its share of the positions)."""
        return self.sampler.pass_length(self.world()[1], 0)

    def batches(self, batch_size: int, drop_last: bool, workers: int) -> int:
        """Batches of an epoch on this rank (the workers take them in turn)."""
        return len(self) // batch_size if drop_last else math.ceil(len(self) / batch_size)

    def __iter__(self):
        if self.batch_size is None:
            raise ValueError("Mix: a mixture with a WebDataset stream makes its rank's batches worker by worker, so "
                             "it must know the loader's batch size: call mix.batching(batch_size, drop_last) with "
                             "the DataLoader's (make_loader does), before iterating")
        return self.samples()

    def samples(self):
        """This worker's batches of the pass, sample by sample."""
        rank, world_size = self.world()
        worker_id, workers = worker()
        epoch, first = self.epoch, 0
        if self.pending is not None and self.pending[0] == epoch:
            first = self.pending[1]
        if self.anchor["chains"] is not None:
            self.check_topology(world_size, workers)
        self.pending = None  # used once: a persistent worker's next passes start their epochs
        for s, ds in self.streams.items():
            if ds.world() != (rank, world_size):
                raise ValueError(f"Mix: stream source {self.names[s]!r} is read as rank {ds.world()[0]} of "
                                 f"{ds.world()[1]}, the mixture as rank {rank} of {world_size}; give both the same "
                                 "rank and world_size (or neither)")
        counts = self.counts_at(rank, workers, epoch, first)[worker_id].tolist()
        kept = self._chains  # a persistent worker's, open where its last pass stopped
        chains = {s: kept[s] if s in kept and kept[s].count == n else
                  Chain(ds, self.chain_size(ds, workers, worker_id, s), n)
                  for (s, ds), n in zip(self.streams.items(), counts)}
        self._chains = chains
        self.sampler.set_epoch(epoch)
        if first:
            self.sampler.load_state_dict({**self.sampler.state_dict(), "epoch": epoch, "start": 0,
                                          "position": min(first * self.batch_size, len(self))})
        indexes = iter(self.sampler)
        for j in range(self.batches(self.batch_size, self.drop_last, workers) - first):
            batch = [index for _, index in zip(range(self.batch_size), indexes)]
            if j % workers == worker_id:
                yield from self.made(batch, chains)

    def chain_size(self, stream: WDSDataset, workers: int, worker_id: int, source: int) -> int:
        size = stream_sizes(len(stream), workers)[worker_id]
        if not size:
            raise ValueError(f"Mix: stream source {self.names[source]!r} has {len(stream)} samples per rank, fewer "
                             f"than the {workers} DataLoader workers, so worker {worker_id} has none of it to read; "
                             "use fewer workers")
        return size

    def made(self, batch: list, chains: dict) -> list:
        """The batch's samples: map-style sources' by index, each stream's from its chain."""
        sources = self.view.source_of(batch)
        out = [None] * len(batch)
        mapped = [k for k, s in enumerate(sources.tolist()) if s not in chains]
        for k, sample in zip(mapped, self.view.__getitems__([batch[k] for k in mapped])):
            out[k] = sample
        for k, s in enumerate(sources.tolist()):
            if s in chains:
                image, label = chains[s].next()
                out[k] = (image, self.view.labels(s, [label])[0], s)
        return out

    # The chains' counts, from the anchor by the schedule.
    def counts_at(self, rank: int, workers: int, epoch: int, batches: int) -> np.ndarray:
        """[worker, stream source] counts of the rank's chains after `batches` batches of `epoch`."""
        anchor = self.anchor
        if (epoch, batches) < (anchor["epoch"], anchor["batches"]):
            raise ValueError(f"Mix: epoch {epoch} batch {batches} comes before where this run's chains were "
                             f"loaded (epoch {anchor['epoch']}, batch {anchor['batches']}); a stream goes forwards")
        if epoch == anchor["epoch"]:
            return self.anchored(rank, workers) + self.drawn(rank, workers, epoch, anchor["batches"], batches,
                                                             anchor["batches"])
        return self.epoch_start(rank, workers, epoch) + self.drawn(rank, workers, epoch, 0, batches, 0)

    def anchored(self, rank: int, workers: int) -> np.ndarray:
        chains = self.anchor["chains"]
        if chains is None:
            return np.zeros((workers, len(self.streams)), dtype=np.int64)
        return np.array([chains[self.names[s]][rank] for s in self.streams], dtype=np.int64).T.reshape(workers, -1)

    def epoch_start(self, rank: int, workers: int, epoch: int) -> np.ndarray:
        """Counts at the start of `epoch` (after the anchor's), walked on from the last one kept."""
        anchor, whole = self.anchor, self.batches(self.batch_size, self.drop_last, workers)
        at, counts = self._walked.get((rank, workers), (epoch + 1, None))
        if at > epoch:  # walk from the anchor: its epoch's rest first
            at = anchor["epoch"] + 1
            counts = self.anchored(rank, workers) + self.drawn(rank, workers, anchor["epoch"], anchor["batches"],
                                                                whole, anchor["batches"])
        for done in range(at, epoch):
            counts = counts + self.drawn(rank, workers, done, 0, whole, 0)
        self._walked[(rank, workers)] = (epoch, counts)
        return counts

    def drawn(self, rank: int, workers: int, epoch: int, begin: int, end: int, shift: int) -> np.ndarray:
        """[worker, stream source] stream draws in batches [begin, end) of the rank's `epoch`,
        batch j made by worker (j - shift) mod workers (shift: where a resumed pass began)."""
        out = np.zeros((workers, len(self.streams)), dtype=np.int64)
        stop = min(end * self.batch_size, len(self))
        world_size = self.world()[1]
        saved, self.sampler.epoch = self.sampler.epoch, epoch
        try:
            for first in range(begin * self.batch_size, stop, CHUNK):
                sources, _ = self.sampler.drawn(0, rank, world_size, first, min(stop, first + CHUNK))
                makers = ((first + np.arange(len(sources))) // self.batch_size - shift) % workers
                for k, s in enumerate(self.streams):
                    out[:, k] += np.bincount(makers[sources == s], minlength=workers)
        finally:
            self.sampler.epoch = saved
        return out

    # The resume state, through make_loader's loader (its position is the rank's batches).
    def settings(self) -> dict:
        return {**self.sampler.settings(), "streams": {self.names[s]: ds.settings() for s, ds in self.streams.items()},
                "batch_size": self.batch_size, "drop_last": self.drop_last}

    def stream_state(self) -> dict:
        """The state's parts besides the loader's position: the settings and the anchor."""
        return {"kind": "MixStream", "version": STATE_VERSION, **self.settings(), "world_size": self.world()[1],
                "anchor": self.anchor, "epoch": self.epoch, "position": None}

    def state_dict(self) -> dict:
        if torch.utils.data.get_worker_info() is not None:
            raise ValueError("Mix: a mixture with a WebDataset stream resumes through readers.make_loader's loader "
                             "(its state holds the rank's batches); a worker's own state (torchdata's "
                             "StatefulDataLoader) is not supported")
        return self.stream_state()

    def load_state_dict(self, state: dict) -> None:
        """The next pass goes on from the state's position: the map-style sources' order where
        it stopped, each chain from its count there (the anchor walked to the position)."""
        check_state(state, "MixStream", self.settings())
        epoch = checked_count(state, "epoch", "MixStream", MAX_EPOCH)
        anchor = checked_anchor(state.get("anchor"), [self.names[s] for s in self.streams])
        self.anchor, self._walked, self._chains = anchor, {}, {}
        self.set_epoch(epoch)
        position = state.get("position")
        if position is None:  # an epoch's start: every chain's count there follows from the anchor
            self.check_topology(state.get("world_size"), anchor.get("workers", 1), {"chains": None})
            self.pending = (epoch, 0)
            return
        if not isinstance(position, dict) or set(position) != {"workers", "batches", "batch_size", "drop_last"}:
            raise ValueError(f"MixStream.load_state_dict: position must be None or make_loader's "
                             f"{{workers, batches, batch_size, drop_last}}, got {shown(position)}")
        batches, workers = checked_count(position, "batches", "MixStream"), position["workers"]
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"MixStream.load_state_dict: position's workers must be an int >= 1, got {workers!r}")
        self.check_topology(state.get("world_size"), workers, anchor)
        # Anchored anew here: the resumed pass's worker w makes its batches w, w + K, ... from this batch on.
        world_size = self.world()[1]
        chains = {self.names[s]: [] for s in self.streams}
        for rank in range(world_size):
            counts = self.counts_at(rank, workers, epoch, batches)
            for k, s in enumerate(self.streams):
                chains[self.names[s]].append(counts[:, k].tolist())
        self.anchor = {"epoch": epoch, "batches": batches, "world_size": world_size, "workers": workers,
                       "chains": chains}
        self._walked, self.pending = {}, (epoch, batches)

    def check_topology(self, world_size, workers: int, anchor: dict | None = None) -> None:
        """Refuse a resume on other ranks or DataLoader workers than the state's chains ran on."""
        anchor = self.anchor if anchor is None else anchor
        saved = (anchor.get("world_size", world_size), anchor.get("workers", workers))
        if saved != (world_size, workers) or world_size != self.world()[1]:
            raise ValueError(f"Mix: the state was saved on {shown(saved[0])} rank(s) x {saved[1]} DataLoader "
                             f"worker(s), and here there are {self.world()[1]} x {workers}; each (rank, worker) "
                             "reads its own chain of the stream source(s) "
                             f"{', '.join(self.names[s] for s in self.streams)}, so a mixture with a WebDataset "
                             "stream resumes on the ranks and workers it was saved on (docs/mixing.md)")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_chains"] = {}  # open streams stay with the process that reads them
        if multiprocessing.context.get_spawning_popen() is None:
            state["_epoch"] = self.epoch  # plain pickling: the value travels, not the memory
        if self.sampler.rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            sampler = state["sampler"] = type(self.sampler).__new__(type(self.sampler))
            sampler.__dict__.update(self.sampler.__dict__)  # a spawned worker has no process group
            sampler.rank, sampler.world_size = self.world()
        return state

    def __repr__(self) -> str:
        return f"Mix(streams {', '.join(self.names[s] for s in self.streams)}; {self.view!r})"


def checked_anchor(anchor, names: list[str]) -> dict:
    """A state's anchor: START, or an epoch, batches, world_size, workers and each stream's
    counts per rank and worker, checked."""
    if anchor == START:
        return dict(START)
    if not isinstance(anchor, dict) or set(anchor) != {"epoch", "batches", "world_size", "workers", "chains"}:
        raise ValueError(f"MixStream.load_state_dict: anchor must be a dict of epoch, batches, world_size, workers "
                         f"and chains, as state_dict() gives it, got {shown(anchor)}")
    for key in ("epoch", "batches", "world_size", "workers"):
        checked_count(anchor, key, "MixStream", MAX_EPOCH if key == "epoch" else None)
    chains = anchor["chains"]
    if not isinstance(chains, dict) or list(chains) != names or not all(
            isinstance(ranks, list) and len(ranks) == anchor["world_size"] and all(
                isinstance(row, list) and len(row) == anchor["workers"]
                and all(type(n) is int and n >= 0 for n in row) for row in ranks) for ranks in chains.values()):
        raise ValueError(f"MixStream.load_state_dict: the anchor's chains must hold, for each stream source "
                         f"({', '.join(names)}), a count >= 0 per worker per rank, got {shown(chains)}")
    return {**anchor, "chains": {n: [list(row) for row in rows] for n, rows in chains.items()}}
