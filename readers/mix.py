"""Mixtures: several map-style datasets read as one, each giving its weight's share of every epoch.

Mix({"imagenet": a, "web": b}, weights={"imagenet": 0.7, "web": 0.3}) is a Dataset whose
index space is the sources end to end (mix[i] -> (image, label, source)); MixSampler walks
it: the epoch's global order is a sequence of (source, draw) computed per position, so
nothing of the epoch's size is held and the order depends on (seed, epoch) alone, and its
elastic resume is readers.elastic's, as for the single-dataset samplers (docs/mixing.md).

The schedule (which source each position belongs to): position x goes to the source whose
prefix count grows at x, the counts splitting every prefix of the epoch by the weights at
each node of a binary tree of the sources (floor(x f + 1/2): each within 1 of x times its
weight at every node), so every run of positions holds its weight's share within 1 or 2.
W ranks take the positions W at a time (readers.elastic), and Schedule.dealt lays each
step's W draws on the ranks by source, so that every rank's own run of batches holds the
shares as well (a rank's stride through a fixed interleave aliases with it).

Draws: the k-th draw of source s, counted over the whole run (its passes carry on across
the mixture's epochs), is pass k // len(s), element k mod len(s) of that pass's order, a
readers.permutation.KeyedPermutation keyed by (seed, source name, pass) (or shuffled
blocks for order="block"): a source drawn more repeats a sample only after all of its
samples; one drawn less covers new samples each epoch until all are seen.

A weight change on resume (Mix(reweight=True)) starts a new segment of the schedule where
the saved run stopped: the draws of each source so far, kept, and the new weights from
there on. The state holds the segment, O(sources).

With a WebDataset stream among the sources, Mix(...) is readers.mix_stream.MixStream, which
reads this schedule and fills a stream's places from the stream of each rank and worker.
"""
from __future__ import annotations

import math
import operator
import zlib
from bisect import bisect_right
from functools import partial
from itertools import compress, repeat
from operator import attrgetter
from typing import Callable

import numpy as np
import torch.utils.data

from ._mix_checks import UNLABELED, checked_kind, checked_sources, checked_weights, merged_labels
from ._mix_checks import source_fingerprint
from .mix_stream import MixStream, is_stream, stream_views
from .elastic import consumed, elastic_fields, ended, pass_length, rank_positions
from ._state_limits import shown
from .keyed import KeyedIndex, keyed_by
from .permutation import KeyedPermutation
from .sampler import BLOCK_SIZE, SAMPLER_STATE_VERSION, WINDOW, RankedSampler, check_state, checked_count, reader_of

CHUNK = 4096  # positions a rank's pass maps at a time
MOST = 2 ** 62  # a count no run reaches: the bound for numbers read from a state
ORDERS = ("random", "block", "sequential")  # how each source's passes run
PASSES_KEPT = 16  # source passes whose keys are kept between chunks
SCHEDULE = "interleave, dealt by source"  # states of another schedule would resume at other samples
# Where three or more sources' runs in a step are laid out on the ranks: a rotation by the golden
# ratio, whose successive points are the most evenly spread of any rotation (docs/mixing.md).
ROTATION = (math.sqrt(5) - 1) / 2


def split_counts(x, weights: tuple[float, ...]) -> np.ndarray:
    """How many of the first x positions of a schedule each source takes (x an int or an
    array of them; the sources on the last axis): the sources halved recursively, each
    node's x split by its halves' weights, rounded; monotone in x."""
    x = np.asarray(x, dtype=np.int64)
    out = np.zeros(x.shape + (len(weights),), dtype=np.int64)
    split_into(out, weights, 0, len(weights), x)
    return out


def split_into(out: np.ndarray, weights: tuple[float, ...], lo: int, hi: int, x: np.ndarray) -> None:
    """split_counts' node over sources [lo, hi) (a function of its own, not a closure: a
    closure that calls itself is a reference cycle, which would hold each chunk's arrays
    until the garbage collector ran)."""
    if hi - lo == 1:
        out[..., lo] = x
        return
    mid = (lo + hi) // 2
    left, right = sum(weights[lo:mid]), sum(weights[mid:hi])
    share = (np.zeros_like(x) if left == 0 else x if right == 0
             else np.floor(x * (left / (left + right)) + 0.5).astype(np.int64))
    split_into(out, weights, lo, mid, share)
    split_into(out, weights, mid, hi, x - share)


class Schedule:
    """Which source, and which draw of it, stands at each position of an epoch: the
    weights' schedule over epochs of `size`, from position `start` of epoch `epoch` on,
    where each source had made `draws` draws.

    Position x of the piece holds the source whose prefix count (split_counts) grows from x
    to x + 1, as that source's split_counts(x)-th draw of the piece: a fixed interleave, so
    every run of positions holds its weight's share within 1 or 2. A step of W ranks takes
    one run of W positions (readers.elastic); `dealt` lays the run's draws on the ranks so
    that every rank's own sequence holds the shares too (a rank's stride through a fixed
    sequence aliases with it: 0.5/0.5 alternated gives rank 0 of 2 one source only)."""

    def __init__(self, weights: tuple[float, ...], size: int, seed: int, epoch: int = 0, start: int = 0,
                 draws: tuple[int, ...] | None = None):
        self.weights, self.size, self.seed = weights, size, seed
        self.epoch, self.start = epoch, start
        self.draws = np.array(draws if draws is not None else [0] * len(weights), dtype=np.int64)

    def piece(self, epoch: int) -> tuple[int, int]:
        """(first position, positions) of the part of `epoch` this schedule lays out."""
        if epoch < self.epoch:
            raise ValueError(f"MixSampler: epoch {epoch} comes before epoch {self.epoch}, where this run's weights "
                             "took effect (a resume with reweight=True); its order is the earlier run's")
        return (self.start, self.size - self.start) if epoch == self.epoch else (0, self.size)

    def before(self, epoch: int) -> np.ndarray:
        """Draws of each source made before `epoch`'s piece."""
        self.piece(epoch)  # refuses an epoch before this schedule's
        if epoch == self.epoch:
            return self.draws.copy()
        return (self.draws + split_counts(self.size - self.start, self.weights)
                + (epoch - self.epoch - 1) * split_counts(self.size, self.weights))

    def draws_at(self, epoch: int, position: int) -> np.ndarray:
        """Draws of each source made before `position` of `epoch` (in all, over the run)."""
        begin, length = self.piece(epoch)
        return self.before(epoch) + split_counts(min(max(0, position - begin), length), self.weights)

    def at(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw over the run) at each of these positions of `epoch`."""
        begin, _ = self.piece(epoch)
        offsets = np.asarray(positions, dtype=np.int64) - begin
        made = split_counts(offsets, self.weights)
        sources = np.argmax(split_counts(offsets + 1, self.weights) - made, axis=-1)
        return sources, np.take_along_axis(made, sources[:, None], 1)[:, 0] + self.before(epoch)[sources]

    def dealt(self, epoch: int, firsts: np.ndarray, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw over the run) that `rank` of `world_size` takes from each run of
        world_size positions of `epoch` starting at `firsts`.

        A run's draws are laid round a circle of the ranks, source by source (the sources'
        arcs); two sources' arcs turn by the first source's draws so far, so the first
        source's draws go to the ranks in turn (round robin) and every rank's count of
        either stays within 1 of its share of the draws made; three or more turn by a
        golden-ratio rotation, within a few. The runs' draws are the schedule's: only which
        rank takes which depends on the world size."""
        begin, _ = self.piece(epoch)
        firsts = np.asarray(firsts, dtype=np.int64) - begin
        made = split_counts(firsts, self.weights)
        counts = split_counts(firsts + world_size, self.weights) - made
        ends = np.cumsum(counts, axis=-1)  # each source's arc: [end - count, end)
        if len(self.weights) == 2:
            turn = made[:, 0]
        else:
            turn = np.floor(np.modf(firsts // world_size * ROTATION)[0] * world_size).astype(np.int64)
        slot = (rank - turn) % world_size
        sources = (slot[:, None] >= ends).sum(axis=1)
        draws = np.take_along_axis(made + counts - ends, sources[:, None], 1)[:, 0] + slot  # made + place in arc
        return sources, draws + self.before(epoch)[sources]


def name_key(name: str) -> int:
    """A source's part of its passes' keys: from its name, so adding or removing another
    source leaves its order as it was."""
    return zlib.crc32(name.encode("utf-8", "surrogateescape"))


def keyed_chunk(indexes: np.ndarray, passes: np.ndarray, prefix: tuple) -> tuple[list, Callable]:
    """(indexes as a list, a function of its iterator giving them as KeyedIndex keyed by
    (*prefix, pass)): a run for RankedSampler.hand_out, keyed as they are taken (a lazy map:
    a list of a chunk's thousands, alive together while its batches are read, measured
    slower). A chunk within one pass has its pass's class make them (readers.keyed.keyed_by:
    int's constructor, no Python frame an index)."""
    numbers, which = np.unique(passes, return_inverse=True)
    if len(numbers) == 1:
        return indexes.tolist(), partial(map, keyed_by((*prefix, int(numbers[0]))))
    keys = np.empty(len(numbers), dtype=object)  # a chunk across a pass's end: one key tuple a pass
    for k, number in enumerate(numbers.tolist()):
        keys[k] = (*prefix, number)
    keyed = keys[which].tolist()
    return indexes.tolist(), lambda current: map(KeyedIndex, current, keyed)


class PassOrder:
    """The order of one pass over a source of n samples: elements at given pass positions."""

    def __init__(self, n: int, key: tuple[int, ...], order: str, block_size: int, window: int, stored=None):
        self.n, self.order, self.block_size, self.window, self.stored = n, order, block_size, window, stored
        self.key = key
        full = n // block_size
        self.blocks = KeyedPermutation(full, key + (-1,)) if order == "block" else None
        self.perm = KeyedPermutation(n, key) if order == "random" else None

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        if self.order == "random":
            return self.perm(positions)
        if self.order == "sequential":
            return np.asarray(positions, dtype=np.int64)
        return self.block_elements(np.asarray(positions, dtype=np.int64))

    def block_elements(self, positions: np.ndarray) -> np.ndarray:
        """Blocks of block_size stored records in a keyed order (a short last block stays
        last), records shuffled within each run of `window` blocks, as BlockShuffleSampler."""
        span = self.block_size * self.window
        out = np.empty(len(positions), dtype=np.int64)
        runs = positions // span
        for w in np.unique(runs).tolist():
            mine = np.flatnonzero(runs == w)
            length = min(span, self.n - w * span)
            inside = KeyedPermutation(length, self.key + (w,))(positions[mine] - w * span)
            slot = w * self.window + inside // self.block_size
            full = self.blocks.n
            block = np.where(slot < full, self.blocks(np.minimum(slot, full - 1)), slot) if full else slot
            out[mine] = block * self.block_size + inside % self.block_size
        return out if self.stored is None else self.stored[out]


class Mix(torch.utils.data.Dataset):
    """Several map-style datasets (any format, local or by URL) read as one, by weight.

    Args:
        sources: {name: dataset}; each a map-style Dataset of (image, label) samples.
        weights: {name: weight >= 0} for every source (normalised; 0 leaves a source out
            of the draws); default: proportional to the sources' sizes.
        seed: the order's seed; the same on every rank.
        epoch_size: samples per epoch; default: the sum of the sources' sizes.
        class_to_idx: {class name: label} for the merged labels; default: the sources'
            classes merged by name, in the order the sources first name them.
        unlabeled: names of sources whose samples are mixed without labels (label -1):
            unlabeled sources, or ones whose classes are not to be merged.
        reweight: a state saved over other weights or sources may be loaded: the samples
            it consumed stay consumed, the rest follows these weights (docs/mixing.md).

    mix[i] is (image, label, source index) for i in the sources' indexes end to end
    (mix.names[source] names it); MixSampler (make_loader's sampler for a Mix) draws
    them by weight. Bad input (weights, an empty source, samples of different kinds,
    labels that do not merge) is refused here, before any batch.

    With a readers.WDSDataset among the sources, Mix(...) is a readers.mix_stream.MixStream,
    an IterableDataset: each stream draw is the next sample of the stream of the rank and
    DataLoader worker that makes its batch (docs/mixing.md).
    """

    def __new__(cls, sources=None, *args, **kwargs):
        if cls is Mix and isinstance(sources, dict) and any(map(is_stream, sources.values())):
            view = Mix(stream_views(sources), *args, **kwargs)
            return MixStream(view, MixSampler(view, "random"), sources)
        return super().__new__(cls)

    def __init__(self, sources: dict, weights: dict | None = None, seed: int = 0, epoch_size: int | None = None, *,
                 class_to_idx: dict | None = None, unlabeled=(), reweight: bool = False):
        self.names, self.sources = checked_sources(sources)
        self.lengths = np.array([len(ds) for ds in self.sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.weights = checked_weights(weights, self.names, self.lengths)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"Mix: seed must be an int, got {seed!r}")
        self.seed = seed
        if epoch_size is None:
            epoch_size = int(self.offsets[-1])
        if isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or not 1 <= epoch_size <= MOST:
            raise ValueError(f"Mix: epoch_size must be a positive int (samples per epoch), or None for the sum of "
                             f"the sources' sizes, got {epoch_size!r}")
        self.epoch_size, self.reweight = epoch_size, bool(reweight)
        self.kind = checked_kind(self.names, self.sources)
        self.classes, self.class_to_idx, self.label_maps = merged_labels(self.names, self.sources, class_to_idx,
                                                                         unlabeled)
        self.kept = [m is not None and np.array_equal(m, np.arange(len(m))) for m in self.label_maps]
        # Each map as a list ending in UNLABELED, which label -1 then indexes: a batch's labels map in C.
        self.label_lists = [None if m is None else [*m.tolist(), UNLABELED] for m in self.label_maps]
        self.fingerprints = [source_fingerprint(ds) for ds in self.sources]
        # A mixture index's source (len(sources) past the end): bisect in C, a batch's in one map.
        self._source_of = partial(bisect_right, self.offsets[1:].tolist())
        decodes = {getattr(ds, "decode", None) for ds in self.sources}
        self.decode = decodes.pop() if len(decodes) == 1 else None  # what make_loader's gpu_decode checks

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, indexes) -> np.ndarray:
        """The source index of each mixture index."""
        return np.searchsorted(self.offsets, np.asarray(indexes, dtype=np.int64), side="right") - 1

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"Mix: index {index} out of range for {len(self)} samples of {len(self.names)} sources")
        s = int(self.source_of(index))
        image, label = self.sources[s][self.local(index, s, int(index) - int(self.offsets[s]))]
        return image, self.label(s, label), s

    def local(self, index, source: int, local: int):
        """The source's own index; keyed (readers.keyed), it carries the run's key with the
        source's name in it, so two sources' samples of one number augment apart."""
        return index.within(self.names[source], local) if isinstance(index, KeyedIndex) else local

    def __getitems__(self, indexes) -> list:
        """[self[i] for i in indexes], each source asked for its part of the batch at once
        (a packed source starts the batch's reads together: readers._dataset); the batch's
        sources, keys and labels are worked out per part, not per sample, by C-level passes
        over the batch (map, compress, bisect), no Python frame a sample and no numpy call a
        batch: between a batch's reads, which sweep the CPU's caches, each numpy call costs
        several times what it does alone."""
        given = indexes if isinstance(indexes, list) else list(indexes)
        if not given:
            return []
        if not all(map(isinstance, given, repeat(int))):  # numpy's or torch's integers: as ints
            given = list(map(operator.index, given))
        sources = list(map(self._source_of, given))
        if min(given) < 0 or len(self.names) in sources:
            raise IndexError(f"Mix: indexes out of range for {len(self)} samples")
        prefix = None  # the batch's key prefix (one pass), or each index's (a batch across passes)
        if isinstance(given[0], KeyedIndex):
            prefixes = list(map(attrgetter("prefix"), given))
            prefix = prefixes[0] if prefixes.count(prefixes[0]) == len(prefixes) else prefixes
        if sources.count(sources[0]) == len(sources):  # one source: its part is the batch
            return self.part(sources[0], given, prefix)
        joined, places = [], []
        for source in sorted(set(sources)):
            mine = list(map(source.__eq__, sources))
            part = prefix if not isinstance(prefix, list) else list(compress(prefix, mine))
            joined += self.part(source, list(compress(given, mine)), part)
            places += compress(range(len(given)), mine)
        return list(map(joined.__getitem__, sorted(range(len(given)), key=places.__getitem__)))

    def part(self, source: int, given: list, prefix) -> list:
        """The samples (image, merged label, source) of one source's part of a batch, `given`
        its mixture indexes; keyed (as KeyedIndex.within) by `prefix` with the source's name
        in it: one tuple for the part, a list of one each, or None (unkeyed)."""
        local = list(map(int.__sub__, given, repeat(int(self.offsets[source]))))
        name = self.names[source]
        if isinstance(prefix, list) and prefix.count(prefix[0]) == len(prefix):
            prefix = prefix[0]
        if isinstance(prefix, tuple):  # one pass: one class makes the part's keys
            local = list(map(keyed_by((*prefix, name)), local))
        elif prefix is not None:
            local = list(map(KeyedIndex, local, [(*each, name) for each in prefix]))
        dataset = self.sources[source]
        samples = dataset.__getitems__(local) if hasattr(dataset, "__getitems__") else [dataset[i] for i in local]
        images, labels = zip(*samples)
        return list(zip(images, self.labels(source, labels), repeat(source)))

    def labels(self, source: int, labels) -> list[int]:
        """The merged labels of a source's labels (UNLABELED stays UNLABELED)."""
        merged = self.label_lists[source]
        if merged is None:
            return [UNLABELED] * len(labels)
        if self.kept[source]:  # the source's labels are the merged ones
            return labels
        return list(map(merged.__getitem__, labels))

    def label(self, source: int, label) -> int:
        labels = self.label_maps[source]
        if labels is None:
            return UNLABELED
        return int(labels[label]) if label != UNLABELED else UNLABELED

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {int(k)} x {w:.3g}" for n, k, w in zip(self.names, self.lengths, self.weights))
        return f"Mix({{{parts}}}, seed={self.seed}, epoch_size={self.epoch_size})"


class MixSampler(RankedSampler):
    """A Mix's indexes, by weight, this rank's share: the epoch's global order is the
    schedule's (source, draw) at each position, mapped through each source's passes.

    Args:
        mix: the readers.Mix.
        order: how each source's passes run: "random" (a keyed permutation per pass),
            "block" (shuffled blocks of storage order, as BlockShuffleSampler), or
            "sequential" (index order; the schedule still interleaves the sources).
        rank, world_size: this process's share; default readers.ranks.world().
        drop_last: a pass leaves out the rest's last (rest mod world size) positions.

    state_dict()/load_state_dict() are the samplers' (readers.sampler.RankedSampler) plus
    the schedule's segment, so a state resumes on any number of ranks and workers.
    """

    def __init__(self, mix: Mix, order: str = "random", block_size: int = BLOCK_SIZE, window: int = WINDOW,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = False,
                 keyed: bool = True):
        if not isinstance(mix, Mix):
            raise ValueError(f"MixSampler: expected a readers.Mix, got {type(mix).__name__}")
        if order not in ORDERS:
            raise ValueError(f"MixSampler: order must be one of {', '.join(ORDERS)}, not {order!r}")
        for name, value in (("block_size", block_size), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MixSampler: {name} must be a positive int, got {value!r}")
        super().__init__(rank, world_size, keyed)
        self.mix, self.order, self.block_size, self.window = mix, order, block_size, window
        self.seed = mix.seed
        self.drop_last = bool(drop_last)
        self.count = mix.epoch_size
        self.schedule = Schedule(mix.weights, mix.epoch_size, mix.seed)
        self.stored = [None] * len(mix.sources)  # storage orders, read when block order first needs them
        self._passes: dict[tuple[int, int], PassOrder] = {}

    def settings(self) -> dict:
        mix = self.mix
        return {"sources": dict(zip(mix.names, mix.fingerprints)), "weights": dict(zip(mix.names, mix.weights)),
                "seed": mix.seed, "epoch_size": mix.epoch_size, "order": self.order, "block_size": self.block_size,
                "window": self.window, "drop_last": self.drop_last, "schedule": SCHEDULE}

    def state_dict(self) -> dict:
        schedule = self.schedule
        segment = {"epoch": schedule.epoch, "start": schedule.start,
                   "draws": dict(zip(self.mix.names, schedule.draws.tolist()))}
        return {**super().state_dict(), "segment": segment}

    def __iter__(self):
        # Not a generator itself: a loaded position is taken when the pass begins (iter()).
        return self.hand_out(self.mixed(self.start()))

    def mixed(self, start: int):
        """This rank's indexes of the current epoch in a pass from `start`, CHUNK of them at a
        time: a list, or keyed, (the list, what keys it) (keyed_chunk; RankedSampler.hand_out)."""
        rank, world_size = self.world()
        share = self.pass_length(world_size, start)
        for first in range(0, share, CHUNK):
            indexes, passes = self.indexes_of(*self.drawn(start, rank, world_size, first, min(share, first + CHUNK)))
            if not self.keyed:
                yield indexes.tolist()
                continue
            # The source's pass is in the key: a source drawn twice in an epoch (weighted above its
            # size) augments each draw of a sample afresh. One KeyedIndex class per pass of the chunk.
            epoch = self._progress[0] if self._progress is not None else self.epoch
            yield keyed_chunk(indexes, passes, (self.seed, epoch))

    def drawn(self, start: int, rank: int, world_size: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw over the run) of this rank's places [first, stop) in a pass from
        `start` (readers.elastic's steps): a whole step's run of positions dealt to the ranks
        by source (Schedule.dealt), a last step short of the ranks and the padding by position."""
        epoch, schedule = self.epoch, self.schedule
        whole = (self.count - start) // world_size  # steps whose run of positions is whole
        split = min(max(first, whole), stop)
        sources, draws = schedule.dealt(epoch, start + world_size * np.arange(first, split, dtype=np.int64),
                                        rank, world_size)
        if split == stop:
            return sources, draws
        positions = rank_positions(self.count, start, rank, world_size, self.drop_last, split, stop)
        begin, length = schedule.piece(epoch)
        if begin:  # a resumed segment's padding wraps round to its own start
            positions = np.where(positions < begin, begin + positions % max(length, 1), positions)
        rest = schedule.at(epoch, positions)
        return np.concatenate([sources, rest[0]]), np.concatenate([draws, rest[1]])

    def indexes_of(self, sources: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The mixture's index of each (source, draw over the run), and the pass of its source
        it is drawn in."""
        out = np.empty(len(sources), dtype=np.int64)
        out_passes = np.empty(len(sources), dtype=np.int64)
        for s in np.unique(sources).tolist():
            mine = np.flatnonzero(sources == s)
            passes, within = np.divmod(draws[mine], int(self.mix.lengths[s]))
            out_passes[mine] = passes
            for p in np.unique(passes).tolist():
                here = passes == p
                out[mine[here]] = self.pass_order(s, p)(within[here]) + self.mix.offsets[s]
        return out, out_passes

    def pass_order(self, source: int, number: int) -> PassOrder:
        """Pass `number` of a source (a few are live at a time: kept, up to PASSES_KEPT)."""
        found = self._passes.get((source, number))
        if found is None:
            if len(self._passes) >= PASSES_KEPT:
                self._passes.clear()
            found = self._passes[(source, number)] = self.new_pass(source, number)
        return found

    def new_pass(self, source: int, number: int) -> PassOrder:
        mix = self.mix
        if self.order == "block" and self.stored[source] is None:
            reader = reader_of(mix.sources[source])
            self.stored[source] = reader.storage_order() if reader is not None else None
        key = (mix.seed, name_key(mix.names[source]), number)
        return PassOrder(int(mix.lengths[source]), key, self.order, self.block_size, self.window,
                         self.stored[source] if self.order == "block" else None)

    def draws(self, epoch: int | None = None, position: int | None = None) -> dict[str, int]:
        """Draws of each source over the run before `position` of `epoch` (default: where
        the pass under way stands on this world): how far each source's passes have gone."""
        epoch = self.epoch if epoch is None else epoch
        if position is None:
            position = consumed(self.count, self.pass_start(), self.handed_out() if self._progress else 0,
                                self.world()[1])
        return dict(zip(self.mix.names, self.schedule.draws_at(epoch, position).tolist()))

    def count_of(self, state: dict) -> int:
        """The epoch size a state's positions count in (a reweighted resume's may differ)."""
        size = state.get("epoch_size") if isinstance(state, dict) else None
        return size if isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= MOST else self.count

    def load_state_dict(self, state: dict) -> None:
        """The samplers' resume (RankedSampler.load_state_dict) with the saved segment; over
        another mixture (weights, sources, epoch size) only where the Mix says reweight=True:
        then the draws made stay made, and the rest of the epoch follows this Mix's weights."""
        check_state(state, "MixSampler", {}, SAMPLER_STATE_VERSION)
        if state.get("schedule") != SCHEDULE:
            raise ValueError(f"MixSampler.load_state_dict: the state was saved under another schedule of the mixture "
                             f"({shown(state.get('schedule'))}, now {SCHEDULE!r}), by an earlier packer; this one "
                             "would resume it at other samples. Start its epoch afresh (set_epoch, no state), or "
                             "finish the run with the packer that saved it")
        now = self.settings()
        replaced = [n for n, fp in (state.get("sources") or {}).items() if n in now["sources"] and fp != now["sources"][n]]
        if replaced:
            name = replaced[0]
            raise ValueError(f"MixSampler.load_state_dict: source {name!r} has changed since the state was saved "
                             f"(saved over {state['sources'][name]}, now {now['sources'][name]}); its pass cannot go "
                             "on over other data: open the saved data again, or give the new data another name in "
                             "the Mix with reweight=True to start its passes afresh")
        fixed = {k: v for k, v in now.items() if k not in ("sources", "weights", "epoch_size")}
        check_state(state, "MixSampler", fixed, SAMPLER_STATE_VERSION)
        changed = [f"{k} {state.get(k)!r} (now {now[k]!r})" for k in ("sources", "weights", "epoch_size")
                   if state.get(k) != now[k]]
        if changed and not self.mix.reweight:
            raise ValueError(f"MixSampler.load_state_dict: the state was saved over another mixture: "
                             f"{'; '.join(changed)}; build the Mix as the saved run did, or pass Mix(..., "
                             "reweight=True) to go on with these weights from where it stopped")
        saved = self.saved_schedule(state)
        if not changed:
            self.schedule = saved
            super().load_state_dict(state)
            return
        self.reweighted(state, saved)

    def saved_schedule(self, state: dict) -> Schedule:
        """The schedule the state was saved under, its numbers checked."""
        segment = state.get("segment")
        names, weights = list(state.get("sources") or {}), state.get("weights")
        if not isinstance(segment, dict) or not isinstance(weights, dict) or list(weights) != names or not names:
            raise ValueError("MixSampler.load_state_dict: the state's segment, sources and weights must be dicts "
                             "over the same sources, as state_dict() gives them")
        for name in names:
            w = weights[name]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1:
                raise ValueError(f"MixSampler.load_state_dict: weight of {name!r} must be in [0, 1], got {w!r}")
        size = checked_count(state, "epoch_size", "MixSampler", MOST)
        epoch = checked_count(segment, "epoch", "MixSampler", MOST)
        start = checked_count(segment, "start", "MixSampler", size)
        draws = segment.get("draws")
        if not isinstance(draws, dict) or list(draws) != names:
            raise ValueError("MixSampler.load_state_dict: the segment's draws must name the state's sources")
        counts = tuple(checked_count(draws, name, "MixSampler", MOST) for name in names)
        last = checked_count(state, "epoch", "MixSampler", MOST)
        if epoch > last + 1 or (last + 1) * size + max(counts) > MOST:  # draws count in int64
            raise ValueError(f"MixSampler.load_state_dict: the segment's epoch {epoch} or the draws ({max(counts)}) "
                             f"do not fit a state of epoch {last} of {size} samples; save and load whole states "
                             "from state_dict()")
        return Schedule(tuple(float(weights[n]) for n in names), size, self.mix.seed, epoch, start, counts)

    def reweighted(self, state: dict, saved: Schedule) -> None:
        """Go on from a state of another mixture: a new segment of this one's schedule where it stopped."""
        epoch = checked_count(state, "epoch", "MixSampler", MOST)
        world_size, start, position = elastic_fields(state, "MixSampler", saved.size, self.drop_last)
        over = ended(saved.size, start, position, world_size, self.drop_last)  # its epoch wholly consumed
        at = saved.size if over else consumed(saved.size, start, position, world_size)
        made = dict(zip(state["sources"], saved.draws_at(epoch, at).tolist()))
        draws = tuple(made.get(name, 0) for name in self.mix.names)
        if over or at >= self.count:  # nothing of the saved epoch is left: the next one starts the segment
            self.schedule = Schedule(self.mix.weights, self.count, self.mix.seed, epoch + 1, 0, draws)
            self._resume = (epoch, self.count)
        else:
            self.schedule = Schedule(self.mix.weights, self.count, self.mix.seed, epoch, at, draws)
            self._after = self.epoch if self._after is None else self._after
            self.epoch, self._resume = epoch, (epoch, at)
