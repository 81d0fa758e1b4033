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
computed from the schedule alone (readers._mix_chains.Counts).

The resume state holds an anchor: where the run began or a state was loaded, with each
chain's count there and each stream's base (readers._mix_chains). Every chain's count at
any later batch follows from the anchor by the schedule, so the state stays O(sources x
ranks x workers) numbers. A state resumes exactly on the ranks and workers that saved it;
elsewhere, or over other weights or sources (reweight=True), the chains fold into each
stream's base and the rest of the epoch is dealt anew (readers._mix_stream_state). A
worker's own state (torchdata's StatefulDataLoader) is its round's first batch and its
chains' counts, and resumes exactly.
"""
from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context

import torch.distributed
import torch.utils.data

from ._mix_chains import BASE, START, ChainEpochs, Counts, Walk
from ._mix_stream_state import SavedState, own_state, pooled_resume
from .ranks import worker
from .sampler import STATE_VERSION
from .wds import WDSDataset


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
    """One stream source's chain in this (rank, worker): the WDSDataset's stream of them, its
    epochs one after the other from its base (`epochs`, a ChainEpochs); `count` samples read
    since the base."""

    def __init__(self, stream: WDSDataset, epochs: ChainEpochs, worker_id: int, count: int):
        self.stream, self.epochs, self.worker_id, self.count = stream, epochs, worker_id, count
        self.samples, self.end = None, count

    def next(self):
        while True:
            if self.samples is None:
                k, offset, size = self.epochs.at(self.worker_id, self.count)
                self.end = self.count - offset + size
                self.samples = self.opened(self.epochs.epoch(k), offset, self.epochs.history(k))
            sample = next(self.samples, None) if self.count < self.end else None
            if sample is not None:
                self.count += 1
                return sample
            # The epoch's run ended (short only where on_error="skip" left out a damaged shard).
            self.count, self.samples = self.end, None

    def opened(self, epoch: int, offset: int, history: list[dict]):
        """The stream's epoch `epoch` from its `offset`-th sample, after the passes of its
        history: loaded as WDSDataset's own state, so the epoch shared with the main
        process is left as it is."""
        rank, world_size = self.stream.world()
        worker_id, workers = worker()
        position = {"rank": rank, "worker": worker_id, "workers": workers, "samples": offset}
        if history:
            position["history"] = history
        self.stream.load_state_dict({**self.stream.stream_state(), "epoch": epoch,
                                     "position": position if offset or history else None})
        return iter(self.stream)


class MixStream(torch.utils.data.IterableDataset):
    """readers.Mix with WebDataset streams among its sources (docs/mixing.md).

    Iterated in a DataLoader, worker w of K makes batches w, w + K, ... of its rank's
    positions: it must know the loader's batch size and drop_last (make_loader tells it;
    for a plain DataLoader call batching()). Each sample is (image, label, source).
    Resumes through make_loader's loader: exactly on the ranks and workers the state was
    saved with, and elsewhere, or with reweight=True over other weights or sources, with
    the rest of the epoch dealt anew (readers._mix_chains).
    """

    def __init__(self, view, sampler, sources: dict):
        self.view, self.sampler, self.names = view, sampler, view.names
        self.streams = {view.names.index(name): ds for name, ds in sources.items() if is_stream(ds)}
        self.classes, self.class_to_idx, self.decode = view.classes, view.class_to_idx, view.decode
        self.batch_size, self.drop_last, self.workers = None, False, None
        self.anchor = dict(START)
        self.pending: tuple[int, int] | None = None  # (epoch, batches) a loaded state's pass starts at
        self.pass_epoch: int | None = None  # a worker's loaded state's epoch, for its pass alone
        self.progress: dict | None = None  # this process's pass: epoch, start, its next round's first batch, chains
        self._epoch = multiprocessing.Value("q", 0, lock=False)  # shared with persistent workers
        self._counts: dict = {}  # world size -> Counts from the anchor
        self._epochs: dict = {}  # (stream source, world size, workers) -> its ChainEpochs from the anchor's base
        self._chains: dict = {}  # this process's chains, by source

    def batching(self, batch_size: int, drop_last: bool, workers: int | None = None) -> None:
        """The loader's batch size, drop_last and DataLoader workers (0 or 1: none), which
        fix what each worker makes."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"Mix.batching: batch_size must be a positive int, got {batch_size!r}")
        self.batch_size, self.drop_last = batch_size, bool(drop_last)
        self.workers = None if workers is None else max(1, int(workers))
        self._counts = {}

    @property
    def epoch(self) -> int:
        if self.pass_epoch is not None:
            return self.pass_epoch
        return self._epoch if isinstance(self._epoch, int) else self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        self.pass_epoch = None
        if isinstance(self._epoch, int):
            self._epoch = int(epoch)
        else:
            self._epoch.value = int(epoch)

    def world(self) -> tuple[int, int]:
        return self.sampler.world()

    def __len__(self) -> int:
        """Samples this rank reads per epoch (its share of the positions)."""
        return self.sampler.pass_length(self.world()[1], 0)

    def pass_begin(self, epoch: int) -> tuple[int, int]:
        """(first position, first batch) of `epoch`'s pass: the anchor's pass in its epoch."""
        start = self.anchor["start"] if epoch == self.anchor["epoch"] else 0
        first = self.pending[1] if self.pending is not None and self.pending[0] == epoch else 0
        return start, first

    def batches(self, batch_size: int, drop_last: bool, workers: int) -> int:
        """Batches of an epoch on this rank (the workers take them in turn): a whole one's,
        also for a resumed pass's shorter rest (frameworks read a loader's length once)."""
        n = len(self)
        return n // batch_size if drop_last else math.ceil(n / batch_size)

    def __iter__(self):
        self.check_batching("iterating")
        return self.samples()

    def check_batching(self, before: str) -> None:
        if self.batch_size is None:
            raise ValueError("Mix: a mixture with a WebDataset stream makes its rank's batches worker by worker, so "
                             "it must know the loader's batch size: call mix.batching(batch_size, drop_last) with "
                             f"the DataLoader's (make_loader does), before {before}")

    def samples(self):
        """This worker's batches of the pass, sample by sample."""
        rank, world_size = self.world()
        worker_id, workers = worker()
        epoch = self.epoch
        start, first = self.pass_begin(epoch)
        self.check_topology(world_size, workers)
        self.pending = self.pass_epoch = None  # used once: a persistent worker's next passes start their epochs
        for s, ds in self.streams.items():
            if ds.world() != (rank, world_size):
                raise ValueError(f"Mix: stream source {self.names[s]!r} is read as rank {ds.world()[0]} of "
                                 f"{ds.world()[1]}, the mixture as rank {rank} of {world_size}; give both the same "
                                 "rank and world_size (or neither)")
        counts = self.counts(world_size).at(rank, workers, epoch, first)[worker_id].tolist()
        kept = self._chains  # a persistent worker's, open where its last pass stopped
        chains = {s: kept[s] if s in kept and kept[s].count == n else
                  Chain(ds, self.chain_epochs(s, world_size, workers, worker_id), worker_id, n)
                  for (s, ds), n in zip(self.streams.items(), counts)}
        self._chains = chains
        walk = self.counts(world_size).walk
        if walk.length(start) == 0:
            return
        self.sampler.set_epoch(epoch)
        self.sampler.load_state_dict({**self.sampler.state_dict(), "epoch": epoch, "start": start,
                                      "position": min(first * self.batch_size, walk.length(start))})
        indexes = iter(self.sampler)
        self.progress = {"epoch": epoch, "start": start, "first": first, "chains": counts}
        for j in range(walk.batches(start) - first):
            batch = [index for _, index in zip(range(self.batch_size), indexes)]
            if j % workers == worker_id:
                samples = self.made(batch, chains)
                # Counted before the batch is handed on: torchdata takes a worker's state after its batch.
                self.progress = {"epoch": epoch, "start": start, "first": first + j + workers - worker_id,
                                 "chains": [chain.count for chain in chains.values()]}
                yield from samples

    def chain_epochs(self, source: int, world_size: int, workers: int, worker_id: int) -> ChainEpochs:
        key = (source, world_size, workers)
        if key not in self._epochs:
            stream = self.streams[source]
            self._epochs[key] = ChainEpochs(stream, self.anchor["bases"].get(self.names[source], BASE),
                                            world_size, workers)
        if not self._epochs[key].whole[worker_id]:
            raise ValueError(f"Mix: stream source {self.names[source]!r} has {len(self.streams[source])} samples per "
                             f"rank, fewer than the {workers} DataLoader workers, so worker {worker_id} has none of "
                             "it to read; use fewer workers")
        return self._epochs[key]

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

    def counts(self, world_size: int) -> Counts:
        """The chains' counts on `world_size` ranks, from the anchor by this mixture's schedule."""
        if world_size not in self._counts:
            walk = Walk(self.sampler, list(self.streams), world_size, self.batch_size, self.drop_last)
            self._counts[world_size] = Counts(self.anchor, walk, [self.names[s] for s in self.streams])
        return self._counts[world_size]

    def check_topology(self, world_size: int, workers: int) -> None:
        """Refuse a pass on other ranks or DataLoader workers than the anchor's chains ran on
        (a loaded state is folded for this loader's: make_loader tells the mixture its workers)."""
        anchor = self.anchor
        if anchor["chains"] is not None and (anchor["world_size"], anchor["workers"]) != (world_size, workers):
            raise ValueError(f"Mix: the state was saved on {anchor['world_size']} rank(s) x {anchor['workers']} "
                             f"DataLoader worker(s), and here there are {world_size} x {workers}; each (rank, "
                             "worker) reads its own chain of the stream sources, which a state loaded through "
                             "readers.make_loader's loader deals anew to its ranks and workers: load it there, or "
                             "call mix.batching(batch_size, drop_last, workers) with this loader's before loading")

    # The resume state, through make_loader's loader (its position is the rank's batches).
    def settings(self) -> dict:
        return {**self.sampler.settings(), "streams": {self.names[s]: ds.settings() for s, ds in self.streams.items()},
                "batch_size": self.batch_size, "drop_last": self.drop_last}

    def stream_state(self) -> dict:
        """The state's parts besides the loader's position: the settings, the schedule's
        segment, the workers and the anchor."""
        return {"kind": "MixStream", "version": STATE_VERSION, **self.settings(), "world_size": self.world()[1],
                "workers": self.workers, "segment": self.sampler.state_dict()["segment"], "anchor": self.anchor,
                "epoch": self.epoch, "position": None}

    def state_dict(self) -> dict:
        """This process's own state (torchdata's StatefulDataLoader takes each worker's): the
        pass's epoch and start, the batch this worker's next round starts at, and its chains'
        counts; make_loader's loader saves stream_state() instead, with the rank's batches."""
        self.check_batching("saving its state")
        rank, world_size = self.world()
        worker_id, workers = worker()
        progress = self.progress
        if progress is None or progress["epoch"] != self.epoch:  # no batch made yet: where the pass begins
            start, first = self.pass_begin(self.epoch)
            progress = {"epoch": self.epoch, "start": start, "first": first,
                        "chains": self.counts(world_size).at(rank, workers, self.epoch, first)[worker_id].tolist()}
        anchor = {**self.anchor, "world_size": None, "workers": None, "chains": None}  # its bases: the counts' own
        return {**self.stream_state(), "anchor": anchor, "epoch": progress["epoch"],
                "worker": {"rank": rank, "worker": worker_id, "workers": workers, "start": progress["start"],
                           "first": progress["first"],
                           "chains": dict(zip((self.names[s] for s in self.streams), progress["chains"]))}}

    def load_state_dict(self, state: dict) -> None:
        """The next pass goes on from the state's position: on the ranks and workers it was
        saved on, the map-style sources' order where it stopped and each chain from its count
        there; on others, or over other weights or sources (reweight=True), the rest of the
        epoch dealt anew, each stream going on from the rest of its epochs (readers._mix_chains)."""
        self.check_batching("loading a state")
        if isinstance(state, dict) and "worker" in state:
            self.resume_worker(own_state(self, state))
            return
        if isinstance(state, dict) and "pooled" in state:  # readers.for_workers' pool of a rank's workers
            self.resume_worker(pooled_resume(self, state))
            return
        saved = SavedState(self, state)
        self._counts, self._epochs, self._chains = {}, {}, {}
        self.set_epoch(saved.epoch)
        if saved.exact(self):
            self.sampler.load_state_dict(saved.sampler_state)  # its schedule's segment
            self.anchor = saved.anchor
            self.resumed_here(saved)
        else:
            self.anchor = saved.folded(self)
            self.pending = (saved.epoch, 0)

    def resumed_here(self, saved) -> None:
        """Go on from a state of this run's ranks and workers: re-anchored at its batch, the
        resumed pass's worker w making its batches w, w + K, ... from there."""
        world_size, batches = self.world()[1], saved.pass_batches
        self.pending = (saved.epoch, batches)
        if saved.position is None:  # an epoch's start: every chain's count there follows from the anchor
            return
        names = [self.names[s] for s in self.streams]
        chains = {name: [] for name in names}
        for rank in range(world_size):
            counts = self.counts(world_size).at(rank, saved.workers, saved.epoch, batches)
            for k, name in enumerate(names):
                chains[name].append(counts[:, k].tolist())
        self.anchor = {**self.anchor, "epoch": saved.epoch, "start": saved.start, "batches": batches,
                       "skipped": saved.position["batches"] - batches, "world_size": world_size,
                       "workers": saved.workers, "chains": chains}
        self._counts = {}

    def resume_worker(self, own: dict) -> None:
        """Go on from this worker's own state (own_state's: its round's first batch, its chains'
        counts in its anchor), or its rank's workers' pooled (pooled_resume's). Its epoch is
        for its pass alone (the epoch is shared with the main process, whose next passes run
        the one set there)."""
        self.anchor = own["anchor"]
        self._counts, self._epochs, self._chains, self.progress = {}, {}, {}, None
        self.pass_epoch, self.pending = own["epoch"], (own["epoch"], own["first"])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_chains"] = {}  # open streams stay with the process that reads them
        if multiprocessing.context.get_spawning_popen() is None:
            state["_epoch"] = self.epoch  # plain pickling: the value travels, not the memory
        if self.sampler.rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            sampler = state["sampler"] = type(self.sampler).__new__(type(self.sampler))
            sampler.__dict__.update(self.sampler.__dict__)  # a spawned worker has no process group
            sampler.rank, sampler.world_size = self.world()
        state["_counts"] = {}  # its walk holds the sampler, replaced above
        return state

    def __repr__(self) -> str:
        return f"Mix(streams {', '.join(self.names[s] for s in self.streams)}; {self.view!r})"
