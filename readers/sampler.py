"""Samplers that read packed data fast from a cold cache, on any number of ranks.

ShuffleSampler: a random permutation per epoch, with the next records asked of the kernel
ahead of reading (Reader.will_need_records): one process reading in random order
otherwise waits for one disk read at a time, while the disk could serve many at once.
While the records are found already cached, it backs off.

Both orders are stateless: a keyed bijection on [0, N) (readers.permutation, keyed by
seed and epoch) gives the index at any position of an epoch's order, so each pass
computes its indexes a chunk of positions at a time. Nothing the size of the dataset
is built, in any process: the first index of a 10^9-record epoch costs what the first of
a 1,000-record one does, and so does resuming at any position of it.

BlockShuffleSampler: near-sequential reads from storage, well-mixed batches.

A true random permutation makes every read a seek, which on a cold cache is as slow as
the disk's random reads. This sampler cuts the records, in the order they are stored,
into blocks of `block_size` consecutive records, permutes the blocks (the bijection over
blocks), and permutes the records within each run of `window` of them (a bijection per
window); the ranks take that order by position.
Reads stay inside a few contiguous byte ranges at a time, which the sampler asks the
kernel to fetch ahead (Reader.will_need: one large sequential read per block, started
one window early), while a batch still draws from `window` places spread over the whole
dataset. FFCV's QUASI_RANDOM order is the same idea; this one also splits across ranks.

How well batches are mixed depends on how the data is stored: on a dataset packed in
ImageFolder order (classes in runs) a batch sees about `window` blocks' worth of
classes; packed with --shuffle-seed, storage order is already random and any order mixes
fully. class_entropy() measures it (docs/cold-storage.md has the figures).

Resuming (docs/resume.md): a sampler's global order is fixed by (seed, epoch, dataset)
alone, and ranks take it by position (readers.elastic), so the samples consumed are
always the order's first C: state_dict() gives {"kind", "version", "dataset", the
settings, "world_size", "epoch", "start", "position"} as plain ints, bools and strings
(torch.save- and JSON-able), from which C = start + position x world_size, and
load_state_dict(state) makes the next pass the rest from C, dealt to any number of
ranks. The position is the same on every rank (each yields len(self) indexes), so rank
0's state resumes every rank. A state taken while iterating counts the indexes handed
out, which a DataLoader draws ahead of the batches it has yielded: readers.make_loader's
loader and torchdata's StatefulDataLoader record the position of the batches consumed.
"""
from __future__ import annotations

import itertools
import math
import operator
import zlib
from typing import Iterable, Iterator

import numpy as np
import torch.utils.data
import torch.utils.data.distributed

from packer.formats import CAN_ADVISE

from ._pack_identity import reader_identity, without_identity
from ._state_limits import MAX_EPOCH, bounded_int, check_shape, shown
from .elastic import consumed, elastic_fields, ended, pass_length, rank_position_chunks, rank_positions
from .permutation import KeyedPermutation
from .keyed import keyed_by
from .ranks import check_rank, world

BLOCK_SIZE = 64  # records per block: ~7 MB of ImageNet JPEGs, one large read
WINDOW = 16  # blocks shuffled together: the classes a batch can draw from
AHEAD = 64  # records hinted ahead of the one being read in random order
HINT_CHUNK = 16  # records hinted per call: fewer numpy passes, reads still kept in flight
WINDOW_BATCH = 64  # windows whose blocks are worked out at once
STATE_VERSION = 1  # of the loader's and WDSDataset's state dicts
# Of the samplers' state dicts. 2: the orders are keyed bijections; a version 1 state's
# position counted torch.randperm's (ShuffleSampler) or numpy's (BlockShuffleSampler) order.
SAMPLER_STATE_VERSION = 2
CRC_CHUNK = 1 << 20  # order entries CRC'd at a time


def dataset_fingerprint(dataset, order: np.ndarray | None = None) -> str:
    """What a sampler walks, named without its path (a dataset may move between machines):
    the sample count and, for packer data, the split, a CRC-32 of the class names and of
    the storage order given, and the pack's own identity (readers._pack_identity)."""
    name = f"{len(dataset)} samples"
    reader = reader_of(dataset)
    if reader is None:
        return name
    crc = zlib.crc32("\n".join(reader.classes).encode("utf-8", "surrogateescape"))
    if order is not None:  # a chunk at a time: a mapped table is read, never copied whole
        for k in range(0, len(order), CRC_CHUNK):
            crc = zlib.crc32(np.ascontiguousarray(order[k:k + CRC_CHUNK], dtype="<i4"), crc)
    shape = f"{name} of split {reader.split!r}, {len(reader.classes)} classes, crc32 {crc:08x}"
    return shape + reader_identity(reader) if hasattr(reader, "metadata") else shape


def check_state(state, kind: str, expected: dict, version: int = STATE_VERSION) -> None:
    """Raise a ValueError naming every setting where `state` differs from `expected`
    (first, one nested too deep or too large to be any state_dict()'s: _state_limits)."""
    if not isinstance(state, dict):
        raise ValueError(f"{kind}.load_state_dict: expected a dict from {kind}.state_dict(), got "
                         f"{type(state).__name__}")
    check_shape(state, f"{kind}.load_state_dict")
    saved_kind, saved_version = state.get("kind"), state.get("version")
    if saved_kind == kind and isinstance(saved_version, int) and not isinstance(saved_version, bool) \
            and 0 < saved_version < version:
        raise ValueError(f"{kind}.load_state_dict: this state is of version {saved_version}, saved by an earlier "
                         f"packer whose order was another; this packer's (version {version}) would resume it at "
                         "other samples. Start its epoch afresh (set_epoch, no state), or finish the run with "
                         "the packer that saved it")
    if saved_kind != kind or saved_version != version:
        raise ValueError(f"{kind}.load_state_dict: this state is not a {kind} state of version {version} "
                         f"(it says {shown(saved_kind)}, version {shown(saved_version)}); load each object's "
                         "own state_dict()")
    if without_identity(state.get("dataset"), expected.get("dataset", "")):
        raise ValueError(f"{kind}.load_state_dict: the state names the data it was saved over as "
                         f"{shown(state['dataset'])}, without the pack (saved before states named it); this pack "
                         f"is {expected['dataset']!r}: a dataset re-packed from other images of the same count and "
                         "classes looks the same, and would be resumed in the old order over the new images. If "
                         "this is the pack the state was saved over, set the state's \"dataset\" to this pack's name "
                         "and load it again; else start the epoch afresh (docs/resume.md)")
    differ = [f"{key} {shown(state.get(key))} (now {value!r})" for key, value in expected.items()
              if state.get(key) != value]
    if differ:
        raise ValueError(f"{kind}.load_state_dict: the state was saved with a different {', '.join(differ)}; a "
                         "position only resumes the same order over the same data: build this one as the saved "
                         "run was built, or start the epoch afresh")


def checked_count(state: dict, key: str, kind: str, most: int | None = None) -> int:
    """state[key] as an int in [0, most], or a ValueError saying what it is."""
    return bounded_int(state.get(key), key, f"{kind}.load_state_dict", 0, most)


def reader_of(dataset):
    """The packer Reader behind a readers Dataset, or None (a folder, a user dataset)."""
    reader = getattr(dataset, "reader", None)
    return reader if hasattr(reader, "will_need") else None


class RankedSampler(torch.utils.data.distributed.DistributedSampler):
    """What the samplers share: this process's rank and world size (given, or
    readers.ranks.world()'s when both are None), the epoch that reseeds the shuffle, and
    the elastic resume (readers.elastic): a subclass gives the epoch's global order, and
    each pass deals the rest of it, from where a loaded state says, to this world's ranks.

    A DistributedSampler by type only (its constructor is not run): that is how a sampler
    says it deals the ranks their shares already, so that frameworks which shard a
    loader's sampler (Lightning's use_distributed_sampler, its default) leave it as it is
    and call its set_epoch, instead of dealing each rank's share out again.

    Each index is handed out as a readers.keyed.KeyedIndex carrying (seed, epoch), so the
    transform of its sample draws from a generator keyed to the sample, in any loader, on
    any number of ranks and workers (docs/reproducibility.md); keyed=False hands out plain
    ints, leaving the draws to each worker's own generator.
    """

    drop_last = False  # True: a pass leaves out the rest's last (rest mod world size) indexes
    seed = 0
    keyed = True  # hand out KeyedIndex (readers.keyed): augmentation keyed to (seed, epoch, index)

    def __init__(self, rank: int | None, world_size: int | None, keyed: bool = True):
        check_rank(rank, world_size, type(self).__name__)
        self.rank, self.world_size, self.keyed = rank, world_size, bool(keyed)
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples of its global order consumed)
        # [epoch, indexes dealt into runs, global start, the run being handed out] of the last pass
        self._progress: list | None = None
        self._after: int | None = None  # the epoch set before a state was loaded: the passes after its pass

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._after = int(epoch), None

    def world(self) -> tuple[int, int]:
        return world(self.rank, self.world_size)

    @property
    def num_replicas(self) -> int:  # DistributedSampler's name for the world size
        return self.world()[1]

    def settings(self) -> dict:
        """What fixes the global order besides the epoch; a state loads only where these match."""
        raise NotImplementedError

    def order_at(self, positions: np.ndarray) -> np.ndarray:
        """The indexes at `positions` of the current epoch's global order: the order all
        ranks together consume, computed for these positions alone."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """{"kind", "version", settings, "world_size", "epoch", "start", "position"}: the
        pass under way (or the one a loaded state will start) began `start` samples into
        the epoch's global order, and this rank has consumed `position` indexes of it."""
        if self._resume is not None:
            (epoch, start), position = self._resume, 0
        elif self._progress is not None and self._progress[0] == self.epoch:
            epoch, start, position = self._progress[0], self._progress[2], self.handed_out()
        else:
            epoch, position, start = self.epoch, 0, 0
        return {"kind": type(self).__name__, "version": SAMPLER_STATE_VERSION, **self.settings(),
                "world_size": self.world()[1], "epoch": epoch, "start": start, "position": position}

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass the saved epoch's, the part of its global order that no rank
        of the saving run had consumed, dealt to this run's ranks (any number); the passes
        after it run the epoch set before the load (or after it, with set_epoch). A state
        whose pass was over leaves the epoch as set (its rest is empty). Raises ValueError
        if the state is another sampler's, or was saved over other data or with another seed."""
        kind = type(self).__name__
        check_state(state, kind, self.settings(), SAMPLER_STATE_VERSION)
        epoch = checked_count(state, "epoch", kind, MAX_EPOCH)
        world_size, start, position = elastic_fields(state, kind, self.count, self.drop_last)
        if ended(self.count, start, position, world_size, self.drop_last):
            # Its epoch was wholly consumed: the epoch stays the one set (torchdata loads this as a pass
            # begins, after the loop's set_epoch), and only a pass of the saved epoch is its empty rest.
            self._resume = (epoch, self.count)
        else:  # its pass runs the saved epoch; those after it, the one set (torchdata starts one at once
            # where a DataLoader's drop_last left this pass a rest too short for a batch)
            self._after = self.epoch if self._after is None else self._after
            self.epoch, self._resume = epoch, (epoch, consumed(self.count, start, position, world_size))

    def pass_start(self) -> int:
        """Where in the global order the pending, current or last pass of this epoch starts."""
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1]
        if self._progress is not None and self._progress[0] == self.epoch:
            return self._progress[2]
        return 0

    def pass_length(self, world_size: int, start: int = 0) -> int:
        """Indexes each rank takes in a pass from `start` on `world_size` ranks."""
        return pass_length(self.count, start, world_size, self.drop_last)

    def start(self) -> int:
        """The global start of this pass (a loaded state's, if it is for this epoch; used
        once), recorded as the pass's progress."""
        if self._resume is None and self._after is not None:  # a loaded state's pass began before this one
            self.epoch, self._after = self._after, None
        resume, self._resume = self._resume, None
        start = resume[1] if resume is not None and resume[0] == self.epoch else 0
        self._progress = [self.epoch, 0, start, iter(())]
        return start

    def pass_positions(self, start: int) -> Iterator[np.ndarray]:
        """The places in the global order this rank reads in a pass from `start`, a chunk at a time."""
        rank, world_size = self.world()
        return rank_position_chunks(self.count, start, rank, world_size, self.drop_last)

    def first_positions(self, start: int, most: int) -> np.ndarray:
        """The first `most` places this rank reads in a pass from `start` (set_epoch's hints)."""
        rank, world_size = self.world()
        return rank_positions(self.count, start, rank, world_size, self.drop_last, 0, most)

    def hand_out(self, runs: Iterable) -> Iterator[int]:
        """The pass's indexes, given as runs, handed out one at a time by C iterators
        (itertools.chain over each run's list iterator): no Python frame per index, whose
        cost a warm read of a small record would feel. A run is a list of indexes, each keyed
        as it goes out where the sampler is keyed (a KeyedIndex carrying (seed, epoch) to the
        transform that augments its sample: readers.keyed), or a mixture's (list, a function
        of its iterator that keys them: readers.mix.keyed_chunk), whose keys also name its
        source's pass. Keyed one at a time, never a run at once: a run of live KeyedIndex
        objects is tracked by the cyclic garbage collector, whose passes cost more than the keying."""
        progress = self._progress
        keyed = keyed_by((self.seed, progress[0])) if self.keyed else None

        def dealt() -> Iterator[Iterator[int]]:
            for run in runs:
                indexes, keying = run if isinstance(run, tuple) else (run, None)
                current = iter(indexes)
                progress[1] += len(indexes)
                progress[3] = current  # handed_out counts what is left of it
                if keying is not None:
                    yield keying(current)
                else:
                    # int.__new__(keyed, i) is keyed(i) without the class call's lookups: 2/3 of its cost
                    yield current if keyed is None else map(int.__new__, itertools.repeat(keyed), current)
        return itertools.chain.from_iterable(dealt())

    def handed_out(self) -> int:
        """Indexes of the last pass handed out so far: those dealt into runs less what the
        current run still holds, so a state saved between any two indexes is exact."""
        return self._progress[1] - operator.length_hint(self._progress[3])

    def __len__(self) -> int:
        return self.pass_length(self.world()[1], self.pass_start())


class ReadAhead:
    """Hints records to a reader; while every record of a call is already in the page
    cache, it skips a growing number of calls (1, 2, 4 ... MAX_SKIP), so a warm dataset
    pays almost nothing and a cold one is hinted at every call."""

    MAX_SKIP = 64  # calls skipped at most in a row: ~1,000 records at HINT_CHUNK

    def __init__(self, reader):
        self.reader = reader
        self.skip = self.backoff = 0
        self.calls = 0  # calls sent to the reader (tests and curious users)

    def __call__(self, indexes: np.ndarray) -> None:
        if not len(indexes):
            return
        if self.skip:
            self.skip -= 1
            return
        hinted = self.reader.will_need_records(indexes)
        self.calls += 1
        self.backoff = min(max(1, 2 * self.backoff), self.MAX_SKIP) if hinted == 0 else 0
        self.skip = self.backoff

    def skipped(self, calls: int) -> bool:
        """Whether the next `calls` calls would all be skipped, counted as skipped if so: a
        caller then need not work out the records it would hint."""
        if self.skip < calls:
            return False
        self.skip -= calls
        return True

    def take_skips(self) -> int:
        """The calls it would skip next, counted as made: a sampler hands out their records
        in one run, with no call for each."""
        skip, self.skip = self.skip, 0
        return skip


class ShuffleSampler(RankedSampler):
    """A random permutation of `dataset` per epoch, this rank's share, read ahead.

    The epoch's permutation is readers.permutation's keyed bijection, keyed by (seed,
    epoch) and computed a chunk of positions at a time, so a dataset of any size costs
    the same few KB; ranks take it by position with DistributedSampler's equal shares
    and padding (readers.elastic). shuffle=False gives index order, dealt the same way.
    Over a readers Dataset of packed data, the AHEAD records after the one being read are
    hinted to the kernel, HINT_CHUNK at a time, from the process that iterates the
    sampler (the main process, with DataLoader workers): up to AHEAD reads in flight
    instead of one, which on a cold cache reads in random order at near the disk's
    sequential rate. `ahead` sets how many; prefetch=False, or a dataset without a
    packer reader, gives the plain permutation.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False, prefetch: bool = True,
                 ahead: int = AHEAD, keyed: bool = True):
        super().__init__(rank, world_size, keyed)
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ShuffleSampler: ahead must be an int >= 0, got {ahead!r}")
        self.count = len(dataset)
        self.fingerprint = dataset_fingerprint(dataset)  # what a state must have been saved over
        reader = reader_of(dataset)
        # Without posix_fadvise (macOS, Windows) a hint does nothing: none are sent.
        self.reader = reader if prefetch and CAN_ADVISE and hasattr(reader, "will_need_records") else None
        self.shuffle, self.seed, self.drop_last, self.ahead = shuffle, int(seed), drop_last, ahead
        self.read_ahead: ReadAhead | None = None  # the last pass's, for inspection
        self._permutation: KeyedPermutation | None = None  # the last epoch's

    def share(self, world_size: int) -> int:
        """Indexes per rank in a whole epoch (DistributedSampler's num_samples)."""
        return self.pass_length(world_size)

    def permutation(self) -> KeyedPermutation:
        """The current epoch's permutation: the same on any number of ranks and workers."""
        if self._permutation is None or self._permutation.key != (self.seed, self.epoch):
            self._permutation = KeyedPermutation(self.count, (self.seed, self.epoch))
        return self._permutation

    def order_at(self, positions: np.ndarray) -> np.ndarray:
        return self.permutation()(positions) if self.shuffle else np.asarray(positions, np.int64)

    def index_chunks(self, start: int = 0) -> Iterator[np.ndarray]:
        """This rank's indexes for the current epoch in a pass from `start`, in reading
        order, a chunk (readers.elastic.CHUNK) at a time."""
        return (self.order_at(positions) for positions in self.pass_positions(start))

    def settings(self) -> dict:
        return {"dataset": self.fingerprint, "seed": self.seed, "shuffle": bool(self.shuffle),
                "drop_last": bool(self.drop_last)}

    def __iter__(self) -> Iterator[int]:
        # Not a generator itself: a loaded position is taken when the pass begins (iter()).
        return self.hand_out(self.read_ahead_of(self.index_chunks(self.start())))

    def read_ahead_of(self, chunks: Iterator[np.ndarray]) -> Iterator[list]:
        """The chunks' indexes as runs to hand out: a chunk each, or with a reader, HINT_CHUNK
        each, the AHEAD indexes after a run hinted as it is handed out (a warm run takes the
        runs of the hints ReadAhead skips along: one run, one numpy pass, for up to MAX_SKIP)."""
        if self.reader is None:
            for chunk in chunks:
                yield chunk.tolist()
            return
        hint, ahead = ReadAhead(self.reader), self.ahead
        self.read_ahead = hint
        # Indexes not yet handed out, topped up from the chunks to reach AHEAD past the next.
        pending, more = np.zeros(0, np.int64), True

        def top_up(pending: np.ndarray) -> np.ndarray:
            nonlocal more
            while more and len(pending) < ahead + HINT_CHUNK:
                chunk = next(chunks, None)
                more = chunk is not None
                if more:
                    pending = np.concatenate([pending, chunk])
            return pending

        pending = top_up(pending)
        for k in range(0, min(ahead, len(pending)), HINT_CHUNK):
            hint(pending[k:k + HINT_CHUNK])
        while len(pending):
            hint(pending[ahead:ahead + HINT_CHUNK])
            run = HINT_CHUNK * (1 + hint.take_skips())
            yield pending[:run].tolist()
            pending = top_up(pending[run:])


class BlockShuffleSampler(RankedSampler):
    """Indexes of `dataset` in shuffled blocks of storage order, this rank's share only.

    Args:
        dataset: a map-style dataset; readers' datasets over packed data also give their
            storage order (shuffled packs) and take read-ahead hints.
        block_size: consecutive stored records per block.
        window: blocks whose records are shuffled together.
        shuffle: False yields this rank's blocks in storage order, unshuffled.
        seed: the shuffle seed, the same on every rank; set_epoch(n) reshuffles.
        rank, world_size: this process's share; default readers.ranks.world().
        prefetch: start reading each window's blocks one window before they are used.

    The epoch's global order is the same on any number of ranks (readers.elastic): the
    blocks in the order of a keyed bijection over blocks (seed, epoch), cut into windows
    of `window` blocks, each window's records in the order of a bijection of its own
    (seed, epoch, window); ranks take it by position, as ShuffleSampler takes its
    permutation, so every rank reads from the same window at a time, 1/world_size of its
    records, and yields len(self) indexes (at most world_size - 1 padded repeats in all).
    A position's window, block and record are computed, nothing per record is built; a
    shuffled LMDB or HDF5 pack's storage order is read from its mapped table as each
    window is read (a WebDataset pack's is worked out from records.bin, 4 bytes a record). On one machine the ranks share the page cache, so each block is still read
    once; on several, each machine reads every window's blocks (docs/resume.md).
    """

    def __init__(self, dataset, block_size: int = BLOCK_SIZE, window: int = WINDOW, shuffle: bool = True,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None, prefetch: bool = True,
                 keyed: bool = True):
        for name, value in (("block_size", block_size), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockShuffleSampler: {name} must be a positive int, got {value!r}")
        super().__init__(rank, world_size, keyed)
        self.count = len(dataset)
        reader = reader_of(dataset)
        self.reader = reader if prefetch else None
        # The index of the record at each stored position (the pack's mapped table); None: the identity.
        self.stored = reader.storage_order() if reader is not None else None
        self.block_size, self.window, self.shuffle, self.seed = block_size, window, shuffle, int(seed)
        self.fingerprint = dataset_fingerprint(dataset, self.stored)
        self.blocks = math.ceil(self.count / block_size)
        self.windows = math.ceil(self.blocks / window)
        # The last block is short by `deficit` records; every other window holds window x block_size.
        self.deficit = self.blocks * block_size - self.count
        self._epoch: tuple | None = None  # (epoch, block permutation, the short block's window)
        self._starts: tuple | None = None  # (epoch, batch, block_starts of WINDOW_BATCH windows)
        self._hinted: tuple | None = None  # (epoch, the windows set_epoch hinted): hinted_ahead

    def block_order(self) -> tuple[KeyedPermutation | None, int]:
        """(the epoch's permutation of blocks, None unshuffled; the window the short last block lies in)."""
        if self._epoch is None or self._epoch[0] != self.epoch:
            blocks = KeyedPermutation(self.blocks, (self.seed, self.epoch, 0)) if self.shuffle else None
            last = self.blocks - 1
            slot = int(blocks.inverse([last])[0]) if blocks is not None and last >= 0 else last
            self._epoch = (self.epoch, blocks, slot // self.window)
        return self._epoch[1], self._epoch[2]

    def window_of(self, positions: np.ndarray) -> np.ndarray:
        """The window each position of the global order lies in."""
        full = self.window * self.block_size
        short = self.block_order()[1]
        positions = np.asarray(positions, np.int64)
        # Windows up to the short block's are full, those after it start `deficit` earlier.
        return np.where(positions < (short + 1) * full - self.deficit, positions // full,
                        (positions + self.deficit) // full)

    def window_begin(self, w: int) -> int:
        """Where window w begins in the global order."""
        return w * self.window * self.block_size - (self.deficit if w > self.block_order()[1] else 0)

    def block_starts(self, w: int) -> np.ndarray:
        """The stored positions where window w's blocks start, in the order the window lists
        them. Worked out for WINDOW_BATCH windows at once (one vectorised pass of the
        bijection instead of one per window), the last batch kept."""
        batch = w // WINDOW_BATCH
        if self._starts is None or self._starts[:2] != (self.epoch, batch):
            blocks = self.block_order()[0]
            first = batch * WINDOW_BATCH * self.window
            slots = np.arange(first, min(first + WINDOW_BATCH * self.window, self.blocks), dtype=np.int64)
            self._starts = (self.epoch, batch, (slots if blocks is None else blocks(slots)) * self.block_size)
        begin = (w - batch * WINDOW_BATCH) * self.window
        return self._starts[2][begin:begin + self.window]

    def window_blocks(self, w: int) -> list[tuple[int, int]]:
        """Window w's blocks, as [start, stop) stored positions, in the order the window lists them."""
        return [(start, min(start + self.block_size, self.count)) for start in self.block_starts(w).tolist()]

    def stored_at(self, w: int, positions: np.ndarray) -> np.ndarray:
        """The stored positions at these positions of the global order, all in window w."""
        starts = self.block_starts(w)
        sizes = np.minimum(starts + self.block_size, self.count) - starts
        local = np.asarray(positions, np.int64) - self.window_begin(w)
        if self.shuffle:
            local = KeyedPermutation(int(sizes.sum()), (self.seed, self.epoch, 1, w))(local)
        ends = np.cumsum(sizes)
        block = np.searchsorted(ends, local, side="right")
        return starts[block] + local - (ends[block] - sizes[block])

    def order_at(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        found = np.empty(len(positions), np.int64)
        windows = self.window_of(positions)
        for w in np.unique(windows).tolist():
            mine = windows == w
            found[mine] = self.stored_at(w, positions[mine])
        return found if self.stored is None else self.stored[found].astype(np.int64)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch n, and start reading its first windows now: a DataLoader
        starts its workers before it draws the first index, and the fetches overlap that."""
        super().set_epoch(epoch)
        self._hinted = None
        if self.reader is not None:
            hinted = []
            for w in self.window_of(self.first_positions(self.pass_start(), 1)).tolist():
                for ahead in range(w, min(w + 2, self.windows)):  # what the pass's first run hints
                    self.hint(self.window_blocks(ahead))
                    hinted.append(ahead)
            self._hinted = (self.epoch, frozenset(hinted))

    def hinted_ahead(self) -> frozenset:
        """The windows set_epoch hinted for this pass, taken once: the pass does not hint them
        again (a hint of cached pages still walks them: ~75 us a block of 64 records)."""
        hinted, self._hinted = self._hinted, None
        return hinted[1] if hinted is not None and hinted[0] == self.epoch else frozenset()

    def settings(self) -> dict:
        return {"dataset": self.fingerprint, "seed": self.seed, "shuffle": bool(self.shuffle),
                "block_size": self.block_size, "window": self.window}

    def __iter__(self) -> Iterator[int]:
        # Not a generator itself: a loaded position is taken when the pass begins (iter()).
        return self.hand_out(self.read_windows(self.pass_positions(self.start())))

    def read_windows(self, chunks: Iterator[np.ndarray]) -> Iterator[list]:
        """The records at these places of the global order (chunks of them), as runs to hand
        out (a chunk's run in one window each), each window's blocks hinted one window ahead
        of the records read from it."""
        current, hinted = None, self.hinted_ahead()
        for places in chunks:
            windows, edges = window_runs(self.window_of(places))
            for run, w in enumerate(windows.tolist()):
                if w != current:
                    if current is None and w not in hinted:
                        self.hint(self.window_blocks(w))
                    if w + 1 < self.windows and w + 1 not in hinted:
                        self.hint(self.window_blocks(w + 1))  # read ahead while this window is consumed
                    current = w
                positions = self.stored_at(w, places[edges[run]:edges[run + 1]])
                yield (positions if self.stored is None else self.stored[positions]).tolist()

    def hint(self, blocks: list[tuple[int, int]]) -> None:
        if self.reader is not None:
            for start, stop in blocks:
                self.reader.will_need(start, stop)


def window_runs(windows: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(the window of each run of consecutive places in one window, the runs' edges)."""
    cuts = (np.flatnonzero(np.diff(windows)) + 1).tolist()
    edges = [0, *cuts, len(windows)]
    return windows[edges[:-1]] if len(windows) else windows[:0], edges


def class_entropy(labels: np.ndarray, indexes, batch_size: int) -> float:
    """Mean Shannon entropy, in bits, of the class labels in each full batch of indexes.

    The mixing measure: a batch of 64 drawn at random from 100 balanced classes scores
    about 5.5 bits; a batch of one class scores 0.
    """
    labels = np.asarray(labels)
    indexes = np.asarray(list(indexes) if not isinstance(indexes, np.ndarray) else indexes)
    n = len(indexes) // batch_size
    if n == 0:
        raise ValueError(f"class_entropy: fewer than one batch of {batch_size} indexes")
    entropies = []
    for batch in labels[indexes[:n * batch_size]].reshape(n, batch_size):
        counts = np.unique(batch, return_counts=True)[1] / batch_size
        entropies.append(float(-(counts * np.log2(counts)).sum()))
    return float(np.mean(entropies))
