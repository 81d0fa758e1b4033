"""BlockShuffleSampler: near-sequential reads from storage, well-mixed batches, any number of ranks.

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
fully. class_entropy() measures it (README: "Cold storage" has the figures).
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch.utils.data

BLOCK_SIZE = 64  # records per block: ~7 MB of ImageNet JPEGs, one large read
WINDOW = 16  # blocks shuffled together: the classes a batch can draw from


def reader_of(dataset):
    """The packer Reader behind a readers Dataset, or None (a folder, a user dataset)."""
    reader = getattr(dataset, "reader", None)
    return reader if hasattr(reader, "will_need") else None


class BlockShuffleSampler(torch.utils.data.Sampler):
    """Indexes of `dataset` in shuffled blocks of storage order, this rank's share only.

    Args:
        dataset: a map-style dataset; readers' datasets over packed data also give their
            storage order (shuffled packs) and take read-ahead hints.
        block_size: consecutive stored records per block.
        window: blocks whose records are shuffled together.
        shuffle: False yields this rank's blocks in storage order, unshuffled.
        seed: the shuffle seed, the same on every rank; set_epoch(n) reshuffles.
        rank, world_size: this process's share; default torch.distributed's, else one rank.
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
        if (rank is None) != (world_size is None) or (world_size is not None and not 0 <= rank < world_size):
            raise ValueError(f"BlockShuffleSampler: pass rank and world_size together, with 0 <= rank < "
                             f"world_size (got rank={rank}, world_size={world_size})")
        self.count = len(dataset)
        reader = reader_of(dataset)
        self.reader = reader if prefetch else None
        # The index of the record at each stored position; None: the identity.
        self.stored = reader.storage_order() if reader is not None else None
        self.block_size, self.window, self.shuffle, self.seed = block_size, window, shuffle, int(seed)
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def world(self) -> tuple[int, int]:
        if self.rank is not None:
            return self.rank, self.world_size
        from .loader import distributed

        return distributed()

    def blocks(self, rank: int, world_size: int) -> tuple[list[tuple[int, int]], int]:
        """(this rank's blocks as [start, stop) stored positions, the largest rank's record
        count) for the current epoch."""
        n_blocks = math.ceil(self.count / self.block_size)
        order = np.arange(n_blocks)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n_blocks)
        load = [0] * world_size
        mine = []
        for block in order.tolist():
            start = block * self.block_size
            stop = min(start + self.block_size, self.count)
            least = load.index(min(load))
            load[least] += stop - start
            if least == rank:
                mine.append((start, stop))
        return mine, max(load)

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

    def positions(self) -> np.ndarray:
        """Every stored position this rank reads in the current epoch, in order."""
        return np.concatenate([p for _, p in self.windows()] or [np.zeros(0, np.int64)])

    def __iter__(self) -> Iterator[int]:
        pending = self.windows()
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
