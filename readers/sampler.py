"""Samplers that read packed data fast from a cold cache, on any number of ranks.

ShuffleSampler: a true random permutation, as DistributedSampler deals it, with the next
records asked of the kernel ahead of reading (Reader.will_need_records): one process
reading in random order otherwise waits for one disk read at a time, while the disk
could serve many at once. While the records are found already cached, it backs off.

BlockShuffleSampler: near-sequential reads from storage, well-mixed batches.

A true random permutation makes every read a seek, which on a cold cache is as slow as
the disk's random reads. This sampler cuts the records, in the order they are stored,
into blocks of `block_size` consecutive records, shuffles the blocks, and deals them to
the ranks; each rank then shuffles the records within each run of `window` of its blocks.
Reads stay inside a few contiguous byte ranges at a time, which the sampler asks the
kernel to fetch ahead (Reader.will_need: one large sequential read per block, started
one window early), while a batch still draws from `window` places spread over the whole
dataset. FFCV's QUASI_RANDOM order is the same idea; this one also splits across ranks.

How well batches are mixed depends on how the data is stored: on a dataset packed in
ImageFolder order (classes in runs) a batch sees about `window` blocks' worth of
classes; packed with --shuffle-seed, storage order is already random and any order mixes
fully. class_entropy() measures it (docs/cold-storage.md has the figures).

Resuming (docs/resume.md): a sampler's order is fixed by (seed, epoch, world size, dataset),
so its state is that plus a position, the indexes of the epoch's order this rank has
consumed: state_dict() gives {"kind", "version", "dataset", the settings, "epoch",
"position"} as plain ints, bools and strings (torch.save- and JSON-able), and
load_state_dict(state) makes the next pass of that epoch start at that position. The
position is the same on every rank (each yields len(self) indexes), so rank 0's state
resumes any rank. A state taken while iterating counts the indexes handed out, which a
DataLoader draws ahead of the batches it has yielded: readers.make_loader's loader and
torchdata's StatefulDataLoader record the position of the batches consumed instead.
"""
from __future__ import annotations

import itertools
import math
import zlib
from typing import Iterable, Iterator

import numpy as np
import torch.utils.data
import torch.utils.data.distributed

from packer.formats import CAN_ADVISE

from .ranks import check_rank, deal, world

BLOCK_SIZE = 64  # records per block: ~7 MB of ImageNet JPEGs, one large read
WINDOW = 16  # blocks shuffled together: the classes a batch can draw from
AHEAD = 64  # records hinted ahead of the one being read in random order
HINT_CHUNK = 16  # records hinted per call: fewer numpy passes, reads still kept in flight
STATE_VERSION = 1  # of the samplers' and the loader's state dicts


def dataset_fingerprint(dataset, order: np.ndarray | None = None) -> str:
    """What a sampler walks, named without its path (a dataset may move between machines):
    the sample count and, for packer data, the split and a CRC-32 of the class names and
    of the storage order given."""
    name = f"{len(dataset)} samples"
    reader = reader_of(dataset)
    if reader is None:
        return name
    crc = zlib.crc32("\n".join(reader.classes).encode("utf-8", "surrogateescape"))
    if order is not None:
        crc = zlib.crc32(np.ascontiguousarray(order, dtype="<i8").tobytes(), crc)
    return f"{name} of split {reader.split!r}, {len(reader.classes)} classes, crc32 {crc:08x}"


def check_state(state, kind: str, expected: dict) -> None:
    """Raise a ValueError naming every setting where `state` differs from `expected`."""
    if not isinstance(state, dict):
        raise ValueError(f"{kind}.load_state_dict: expected a dict from {kind}.state_dict(), got "
                         f"{type(state).__name__}")
    saved_kind = state.get("kind")
    if saved_kind != kind or state.get("version") != STATE_VERSION:
        raise ValueError(f"{kind}.load_state_dict: this state is not a {kind} state of version {STATE_VERSION} "
                         f"(it says {saved_kind!r}, version {state.get('version')!r}); load each object's own "
                         "state_dict()")
    differ = [f"{key} {state.get(key)!r} (now {value!r})" for key, value in expected.items()
              if state.get(key) != value]
    if differ:
        raise ValueError(f"{kind}.load_state_dict: the state was saved with a different {', '.join(differ)}; a "
                         "position only resumes the same order over the same data: build this one as the saved "
                         "run was built, or start the epoch afresh")


def checked_count(state: dict, key: str, kind: str, most: int | None = None) -> int:
    """state[key] as an int in [0, most], or a ValueError saying what it is."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (most is not None and value > most):
        bound = "" if most is None else f" <= {most}"
        raise ValueError(f"{kind}.load_state_dict: {key} must be an int >= 0{bound}, got {value!r}")
    return value


def reader_of(dataset):
    """The packer Reader behind a readers Dataset, or None (a folder, a user dataset)."""
    reader = getattr(dataset, "reader", None)
    return reader if hasattr(reader, "will_need") else None


class RankedSampler(torch.utils.data.distributed.DistributedSampler):
    """What the samplers share: this process's rank and world size (given, or
    readers.ranks.world()'s when both are None) and the epoch that reseeds the shuffle.

    A DistributedSampler by type only (its constructor is not run): that is how a sampler
    says it deals the ranks their shares already, so that frameworks which shard a
    loader's sampler (Lightning's use_distributed_sampler, its default) leave it as it is
    and call its set_epoch, instead of dealing each rank's share out again.
    """

    def __init__(self, rank: int | None, world_size: int | None):
        check_rank(rank, world_size, type(self).__name__)
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, position) a loaded state starts at
        self._progress: list[int] | None = None  # [epoch, indexes handed out] of the last pass

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def world(self) -> tuple[int, int]:
        return world(self.rank, self.world_size)

    @property
    def num_replicas(self) -> int:  # DistributedSampler's name for the world size
        return self.world()[1]

    def settings(self) -> dict:
        """What fixes the order besides the epoch; a state loads only where these match."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """{"kind", "version", settings, "epoch", "position"}: where the current pass is
        (or where a loaded state will start the next one)."""
        if self._resume is not None:
            epoch, position = self._resume
        elif self._progress is not None and self._progress[0] == self.epoch:
            epoch, position = self._progress
        else:
            epoch, position = self.epoch, 0
        return {"kind": type(self).__name__, "version": STATE_VERSION, **self.settings(), "epoch": epoch,
                "position": position}

    def load_state_dict(self, state: dict) -> None:
        """Set the epoch, and make the next pass over it skip the first state["position"]
        indexes of this rank's order. Raises ValueError if the state is another sampler's,
        or was saved over other data, seed or world size."""
        kind = type(self).__name__
        check_state(state, kind, self.settings())
        epoch = checked_count(state, "epoch", kind)
        self.epoch = epoch
        self._resume = (epoch, checked_count(state, "position", kind, len(self)))

    def start(self) -> int:
        """The position this pass starts at (a loaded state's, if it is for this epoch; used
        once), recorded as the pass's progress."""
        resume, self._resume = self._resume, None
        start = resume[1] if resume is not None and resume[0] == self.epoch else 0
        self._progress = [self.epoch, start]
        return start

    def counted(self, indexes: Iterable[int]) -> Iterator[int]:
        """indexes, each counted in the pass's progress as it is handed out."""
        progress = self._progress
        for index in indexes:
            progress[1] += 1
            yield index


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


class ShuffleSampler(RankedSampler):
    """A random permutation of `dataset` per epoch, this rank's share, read ahead.

    The indexes are exactly torch's DistributedSampler's for the same seed, epoch, ranks
    and drop_last (one rank: the whole permutation). Over a readers Dataset of packed
    data, the AHEAD records after the one being read are hinted to the kernel, HINT_CHUNK
    at a time, from the process that iterates the sampler (the main process, with
    DataLoader workers): up to AHEAD reads in flight instead of one, which on a cold
    cache reads in random order at near the disk's sequential rate. `ahead` sets how
    many; prefetch=False, or a dataset without a packer reader, gives the plain permutation.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False, prefetch: bool = True,
                 ahead: int = AHEAD):
        super().__init__(rank, world_size)
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ShuffleSampler: ahead must be an int >= 0, got {ahead!r}")
        self.count = len(dataset)
        self.fingerprint = dataset_fingerprint(dataset)  # what a state must have been saved over
        reader = reader_of(dataset)
        # Without posix_fadvise (macOS, Windows) a hint does nothing: none are sent.
        self.reader = reader if prefetch and CAN_ADVISE and hasattr(reader, "will_need_records") else None
        self.shuffle, self.seed, self.drop_last, self.ahead = shuffle, int(seed), drop_last, ahead
        self.read_ahead: ReadAhead | None = None  # the last pass's, for inspection

    def share(self, world_size: int) -> int:
        """Indexes per rank (DistributedSampler's num_samples)."""
        if self.drop_last and self.count % world_size:
            return math.ceil((self.count - world_size) / world_size)
        return math.ceil(self.count / world_size)

    def indexes(self) -> np.ndarray:
        """This rank's indexes for the current epoch, in reading order."""
        rank, world_size = self.world()
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.count, generator=generator).numpy()
        else:
            order = np.arange(self.count)
        total = self.share(world_size) * world_size
        if total > len(order) and len(order):  # pad by repeating from the start, as DistributedSampler
            order = np.resize(order, total)
        return order[rank:total:world_size].astype(np.int64)

    def settings(self) -> dict:
        return {"dataset": self.fingerprint, "seed": self.seed, "shuffle": bool(self.shuffle),
                "drop_last": bool(self.drop_last), "world_size": self.world()[1]}

    def __iter__(self) -> Iterator[int]:
        # Not a generator itself: a loaded position is taken when the pass begins (iter()).
        indexes = self.indexes()
        return self.counted(self.read_ahead_of(indexes[self.start():]))

    def read_ahead_of(self, indexes: np.ndarray) -> Iterator[int]:
        if self.reader is None:
            yield from indexes.tolist()
            return
        hint, ahead = ReadAhead(self.reader), self.ahead
        self.read_ahead = hint
        for k in range(0, min(ahead, len(indexes)), HINT_CHUNK):
            hint(indexes[k:k + HINT_CHUNK])
        for k in range(0, len(indexes), HINT_CHUNK):
            hint(indexes[k + ahead:k + ahead + HINT_CHUNK])
            yield from indexes[k:k + HINT_CHUNK].tolist()

    def __len__(self) -> int:
        return self.share(self.world()[1])


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

    Every rank yields len(self) indexes, the largest rank's share, so DDP never hangs: a
    rank with fewer repeats records from the start of its own share (WDSDataset's rule).
    Blocks are dealt whole to ranks, each to the rank holding the fewest records so far,
    so shares are disjoint and reads stay sequential on every rank.
    """

    def __init__(self, dataset, block_size: int = BLOCK_SIZE, window: int = WINDOW, shuffle: bool = True,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None, prefetch: bool = True):
        for name, value in (("block_size", block_size), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockShuffleSampler: {name} must be a positive int, got {value!r}")
        super().__init__(rank, world_size)
        self.count = len(dataset)
        reader = reader_of(dataset)
        self.reader = reader if prefetch else None
        # The index of the record at each stored position; None: the identity.
        self.stored = reader.storage_order() if reader is not None else None
        self.block_size, self.window, self.shuffle, self.seed = block_size, window, shuffle, int(seed)
        self.fingerprint = dataset_fingerprint(dataset, self.stored)

    def blocks(self, rank: int, world_size: int) -> tuple[list[tuple[int, int]], int]:
        """(this rank's blocks as [start, stop) stored positions, the largest rank's record
        count) for the current epoch."""
        n_blocks = math.ceil(self.count / self.block_size)
        order = np.arange(n_blocks)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n_blocks)
        starts = order * self.block_size
        stops = np.minimum(starts + self.block_size, self.count)
        owned, load = deal((((a, b), b - a) for a, b in zip(starts.tolist(), stops.tolist())), world_size)
        return owned[rank], max(load)

    def windows(self) -> Iterator[tuple[list[tuple[int, int]], np.ndarray]]:
        """(blocks, stored positions in the order they are read) per window of this rank."""
        rank, world_size = self.world()
        blocks, share = self.blocks(rank, world_size)
        rng = np.random.default_rng([self.seed, self.epoch, rank])
        for w in range(0, len(blocks), self.window):
            group = blocks[w:w + self.window]
            positions = np.concatenate([np.arange(a, b) for a, b in group])
            if self.shuffle:
                rng.shuffle(positions)
            yield group, positions
        deficit = share - sum(b - a for a, b in blocks)
        if deficit > 0:  # padding: repeat this rank's first records (any rank's, if it has none)
            own = np.concatenate([np.arange(a, b) for a, b in blocks]) if blocks else np.arange(self.count)
            yield [], np.resize(own, deficit)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch n, and start reading its first windows now: a DataLoader
        starts its workers before it draws the first index, and the fetches overlap that."""
        super().set_epoch(epoch)
        if self.reader is not None:
            start = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
            for group, _ in itertools.islice(self.windows_from(start), 2):
                self.hint(group)

    def positions(self) -> np.ndarray:
        """Every stored position this rank reads in the current epoch, in order."""
        return np.concatenate([p for _, p in self.windows()] or [np.zeros(0, np.int64)])

    def settings(self) -> dict:
        return {"dataset": self.fingerprint, "seed": self.seed, "shuffle": bool(self.shuffle),
                "block_size": self.block_size, "window": self.window, "world_size": self.world()[1]}

    def __iter__(self) -> Iterator[int]:
        # Not a generator itself: a loaded position is taken when the pass begins (iter()).
        return self.counted(self.read_windows(self.windows_from(self.start())))

    def windows_from(self, start: int) -> Iterator[tuple[list[tuple[int, int]], np.ndarray]]:
        """windows() less the first `start` positions: whole windows skipped unread (each
        still shuffled, so the generator's draws stay those of the full pass)."""
        for group, positions in self.windows():
            if start >= len(positions):
                start -= len(positions)
                continue
            yield group, positions[start:]
            start = 0

    def read_windows(self, pending: Iterator[tuple[list[tuple[int, int]], np.ndarray]]) -> Iterator[int]:
        current = next(pending, None)
        if current is not None:
            self.hint(current[0])
        while current is not None:
            following = next(pending, None)
            if following is not None:
                self.hint(following[0])  # read ahead while this window is consumed
            indexes = current[1] if self.stored is None else self.stored[current[1]]
            yield from indexes.tolist()
            current = following

    def hint(self, blocks: list[tuple[int, int]]) -> None:
        if self.reader is not None:
            for start, stop in blocks:
                self.reader.will_need(start, stop)

    def __len__(self) -> int:
        rank, world_size = self.world()
        return self.count if world_size == 1 else self.blocks(rank, world_size)[1]


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
