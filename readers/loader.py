"""make_loader: a DataLoader with the settings that keep a GPU fed, checked up front.

What it sets and why:
- workers: the cores this process may run on (os.sched_getaffinity, so taskset, cgroups
  and SLURM bindings are respected) shared among the local DDP ranks;
- persistent_workers when there are workers, so each epoch does not re-fork and
  re-open every dataset handle;
- pin_memory only for CUDA targets (pinning for a CPU target only costs a copy);
- a worker init that pins OpenMP/MKL/torch to one thread per worker (N workers x N
  threads oversubscribes the cores) and seeds torch, numpy and random from the
  worker's seed and the DDP rank, so ranks do not draw identical augmentations;
- for packed data a ShuffleSampler (a keyed permutation per epoch, or index order
  unshuffled, in DistributedSampler's rank shares, with the next records hinted to the kernel so cold
  random reads overlap; a FolderDataset gets the same order, unhinted), else
  DistributedSampler when torch.distributed is initialised (an IterableDataset splits
  itself), or with order="block" a BlockShuffleSampler, which splits across ranks too;
  an epoch counter that advances by itself so shuffles differ per epoch;
- the reader told the access pattern (random: read exactly each record; block or
  sequential: let the kernel read ahead);
- drop_last for training, so every step sees a full batch (BatchNorm, DDP);
- a collate that stacks uint8 images into one shared-memory/pinned buffer; for a CPU
  target (device="cpu") it normalises them too, in the workers.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.data as tud

from packer.cores import available_cores

from ._dataset import ReaderDataset
from ._state_limits import MAX_EPOCH, shown
from .buffers import WorkerBatch
from .collate import Normalise, NormalisedCollate, collate, encoded_collate, to_be_pinned
from .gpu import CUDAPrefetcher, resolve_device
from .heap import keep_heap
from .hybrid import HybridDecoder, hybrid_collate
from .ranks import accelerate_shards, local_world_size, process_rank, world
from .sampler import BLOCK_SIZE, WINDOW, BlockShuffleSampler, ShuffleSampler, reader_of
from .sampler import STATE_VERSION, check_state, checked_count
from .stats import LoaderStats, LoaderWarning

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
# Aim for this many batches ready or in flight across all workers: enough to absorb a
# slow batch, without each worker holding many batches of shared memory.
BATCHES_IN_FLIGHT = 8
ORDERS = ("random", "block", "sequential")
# drop_last dropping at least this share of an epoch is worth a warning.
DROP_WARN_SHARE = 0.1


def default_workers() -> int:
    """Cores available to this process, divided among the ranks on this machine."""
    return max(1, available_cores() // local_world_size())


def worker_init(worker_id: int, rank: int = 0, user_init=None) -> None:
    """Runs in each worker: one thread per library, per-worker and per-rank seeds, and a
    heap kept between batches (readers.heap)."""
    keep_heap()
    for name in THREAD_ENV:
        os.environ[name] = "1"  # for libraries the worker loads from here on
    torch.set_num_threads(1)
    # torch.initial_seed() here is the loader's base seed + worker_id; mix the rank in.
    seed = np.random.SeedSequence([torch.initial_seed() % 2**63, rank, worker_id]).generate_state(2, np.uint64)
    seed = int(seed[0])
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if user_init is not None:
        user_init(worker_id)


class EpochLoader(tud.DataLoader):
    """A DataLoader whose epoch advances on each pass (for its sampler and dataset).

    set_epoch(n) makes the next pass epoch n; without calls, passes are epochs 0, 1, 2...

    state_dict() / load_state_dict(): where training is, for an exact resume in a new
    process (docs/resume.md): the epoch, the batches of it handed out, and the state of
    the sampler (or of an IterableDataset such as WDSDataset) that fixes the order. After
    load_state_dict, the next pass yields the rest of that epoch, then passes go on as
    they would have. Loading restarts persistent workers, so they start from the state.
    """

    _next_epoch = 0
    _resume_batches: int | None = None  # batches of _next_epoch a loaded state has consumed
    _progress: list | None = None  # [epoch, batches handed out, finished, batches before it] of the last pass
    _told: int | None = None  # the epoch this loader last set on its sampler

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.dataset, tud.IterableDataset):
            # Frameworks set the epoch on a loader's sampler only (Lightning does, each epoch):
            # an IterableDataset's has no set_epoch, so this one stands in and carries it over.
            object.__setattr__(self, "sampler", EpochSetter())  # past DataLoader's guard on `sampler`
        self._told = getattr(self.sampler, "epoch", None)

    def __len__(self) -> int:
        """Batches of a whole epoch on this world: frameworks read it once, at setup (Lightning
        caps every epoch at it), so a resumed pass's shorter rest must not shrink it."""
        if isinstance(self.dataset, tud.IterableDataset) and hasattr(self.dataset, "batches"):
            return self.pass_len()
        length = getattr(self.sampler, "pass_length", None)
        if length is None or self.batch_size is None:
            return super().__len__()
        samples = length(self.sampler.world()[1])
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def pass_len(self) -> int:
        """Batches of the pass under way, or of the next: after a resume, the rest of its epoch."""
        length = super().__len__()  # also what torch checks an IterableDataset's batch count against
        if isinstance(self.dataset, tud.IterableDataset) and hasattr(self.dataset, "batches"):
            # Each worker batches its own stream: WDSDataset knows how many batches they make
            # (between passes, of the next one's epoch).
            if self._progress is None or self._progress[2]:
                self.dataset.set_epoch(self.coming_epoch())
            return self.dataset.batches(self.batch_size, self.drop_last, self.num_workers)
        return length

    def coming_epoch(self) -> int:
        """The epoch the next pass runs: one set on the sampler from outside (a framework's,
        through its set_epoch) since this loader last set it, else the loader's own count."""
        outside = getattr(self.sampler, "epoch", None)
        if outside is not None and outside != self._told:
            self.set_epoch(outside)
            self._told = outside
        return self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        if epoch != self._next_epoch:
            self._resume_batches = None  # a loaded position is for its own epoch only
        self._next_epoch = epoch
        self._progress = None

    def __iter__(self):
        if accelerate_shards():
            raise RuntimeError("make_loader: an Accelerator runs several processes here, so this loader holds the "
                               "whole dataset for accelerator.prepare() to shard; pass the loader to "
                               "accelerator.prepare() and iterate what it returns (docs/frameworks.md)")
        return self._pass()

    def _pass(self):
        """One pass, begun at its first batch, not at iter(): Lightning makes the iterator of
        an epoch it resumes at before it sets that epoch on the sampler."""
        epoch = self.coming_epoch()
        self._next_epoch = epoch + 1
        skip, self._resume_batches = self._resume_batches or 0, None
        for target in (self.sampler, self.dataset):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
        self._told = epoch
        progress = self._progress = [epoch, skip, False, skip]
        batches = super().__iter__()
        if self.num_workers and getattr(self.dataset, "_resume", None) is not None:
            self.dataset._resume = None  # the workers took their copies: later ones start afresh
        yield from self._counted(batches, progress)

    @staticmethod
    def _counted(batches, progress: list):
        for batch in batches:
            progress[1] += 1
            # A WorkerBatch is unwrapped by the pin thread; one arrives as it is only if
            # pinning was turned off after the loader was made.
            yield batch.batch if isinstance(batch, WorkerBatch) else batch
        progress[2] = True

    def position(self) -> tuple[int, int]:
        """(epoch, batches of it handed out): of the pass under way, else of the next pass."""
        if self._resume_batches is not None:
            return self._next_epoch, self._resume_batches
        if self.under_way():
            return self._progress[0], self._progress[1]
        return self._next_epoch, 0

    def under_way(self) -> bool:
        """Whether a pass has begun and not ended. One that has handed out every batch, its
        end not yet seen (Lightning saves there, at an epoch's end), is over: a resume starts
        the next epoch."""
        progress = self._progress
        return progress is not None and not progress[2] and not self.ran_out(progress[1] - progress[3])

    def pass_batches(self) -> int | None:
        """Batches handed out in the pass of position(): those of the pass under way, 0 for
        a loaded state's pending pass, None for a pass not begun (it starts the epoch)."""
        if self._resume_batches is not None:
            return 0
        if self.under_way():
            return self._progress[1] - self._progress[3]
        return None

    def ran_out(self, batches: int) -> bool:
        """Whether a pass that handed out `batches` has handed out all of its own (after a
        resume, the rest of its epoch; False where its length is unknown)."""
        try:
            return batches >= self.pass_len()
        except TypeError:  # an IterableDataset without a length
            return False

    def state_dict(self, unconsumed: int = 0) -> dict:
        """Plain data (ints, bools, strings; torch.save- and JSON-able) to resume from.

        unconsumed: batches handed out but not yet trained on (a prefetcher's batch read
        ahead), left out of the position."""
        epoch, batches = self.position()
        batches = max(0, batches - unconsumed)
        pass_batches = self.pass_batches()
        if pass_batches is not None:
            pass_batches = max(0, pass_batches - unconsumed)
        state = {"kind": "EpochLoader", "version": STATE_VERSION, **self._settings(), "epoch": epoch,
                 "batches": batches, "sampler": None, "dataset": None}
        if isinstance(self.dataset, tud.IterableDataset):
            state["workers"] = self.num_workers
            if hasattr(self.dataset, "state_dict"):
                own = getattr(self.dataset, "stream_state", self.dataset.state_dict)  # WDSDataset's, unguarded
                state["dataset"] = {**own(), "epoch": epoch,
                                    "position": self._stream_position(epoch, batches, pass_batches)}
            elif batches:
                raise ValueError(f"EpochLoader.state_dict: {type(self.dataset).__name__} has no state_dict(), so "
                                 "a pass over it cannot be resumed mid-epoch; save at an epoch's end")
        elif hasattr(self.sampler, "state_dict"):
            state["sampler"] = sampler_state(self.sampler, epoch, pass_batches, self.batch_size)
        elif batches:
            raise ValueError(f"EpochLoader.state_dict: the loader's {type(self.sampler).__name__} has no seeded, "
                             "stateful order, so a pass cannot be resumed mid-epoch; use make_loader over packed "
                             "data (readers.LMDBDataset, HDF5Dataset, WDSMapDataset) or a readers.FolderDataset "
                             "(a ShuffleSampler), or save at an epoch's end")
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict()'s result: the next pass is the rest of the saved epoch.
        Raises ValueError naming what differs if it was saved by a loader over other data,
        or with another batch size, seed, world size (or workers, for an IterableDataset)."""
        check_state(state, "EpochLoader", self._settings())
        epoch = checked_count(state, "epoch", "EpochLoader", MAX_EPOCH)
        batches = checked_count(state, "batches", "EpochLoader")
        for name, target in (("sampler", self.sampler), ("dataset", self.dataset)):
            if state.get(name) is not None:
                if not isinstance(state[name], dict):
                    raise ValueError(f"EpochLoader.load_state_dict: the {name} state must be a dict (the "
                                     f"{name}'s state_dict()) or None, got {type(state[name]).__name__}")
                if not hasattr(target, "load_state_dict"):
                    raise ValueError(f"EpochLoader.load_state_dict: the state holds a {name} state and this "
                                     f"loader's {name} ({type(target).__name__}) takes none; it was saved by "
                                     "another kind of loader")
                expected = (sampler_position(self.sampler, state[name], batches, self.batch_size)
                            if name == "sampler" else stream_batches(state[name], batches))
                check_part(state[name], epoch, expected, name)
                target.load_state_dict(state[name])
            elif batches and hasattr(target, "load_state_dict") and (
                    name == "sampler" or isinstance(self.dataset, tud.IterableDataset)):
                raise ValueError(f"EpochLoader.load_state_dict: the state has no {name} state to resume "
                                 f"{type(target).__name__} mid-epoch; it was saved by another kind of loader")
        self._next_epoch, self._resume_batches, self._progress = epoch, batches, None
        self._iterator = None  # persistent workers hold the old state: the next pass starts new ones

    def _settings(self) -> dict:
        return {"batch_size": self.batch_size, "drop_last": bool(self.drop_last)}

    def _stream_position(self, epoch: int, batches: int, pass_batches: int | None) -> dict | None:
        """An IterableDataset's position: None at an epoch's start, else this rank's batches
        (of the pass, after a resume on other ranks or workers, with the passes before it)."""
        history, before = ([], 0)
        if pass_batches is not None and hasattr(self.dataset, "pass_history"):
            history, before = self.dataset.pass_history(epoch, max(1, self.num_workers))
        if pass_batches is None or not (batches or history):
            return None
        position = {"workers": max(1, self.num_workers), "batch_size": self.batch_size, "drop_last": self.drop_last,
                    "batches": before + pass_batches if history else batches}
        return {**position, "history": history} if history else position


def sampler_state(sampler, epoch: int, pass_batches: int | None, batch_size: int) -> dict:
    """The sampler's state at the loader's position: the indexes of the batches handed out
    in this pass (the workers draw ahead of them), or the start of an epoch not begun."""
    state = {**sampler.state_dict(), "epoch": epoch}
    if pass_batches is None:
        return {**state, "position": 0, **({"start": 0} if "start" in state else {})}
    return {**state, "position": min(pass_batches * batch_size, len(sampler))}


def sampler_position(sampler, part, batches: int, batch_size: int):
    """The position a sampler state saved after `batches` batches of its epoch must hold:
    the batches' indexes, for a pass that began the epoch (on the world size that saved
    it); a resumed pass's own count is not the loader's, so its part is taken as it is."""
    world_size = part.get("world_size") if isinstance(part, dict) else None
    if (not hasattr(sampler, "pass_length") or part.get("start", 0) != 0 or isinstance(world_size, bool)
            or not isinstance(world_size, int) or world_size < 1):
        return part.get("position") if isinstance(part, dict) else None
    return min(batches * batch_size, sampler.pass_length(world_size))


def stream_batches(part, batches: int):
    """The batch count a stream's state saved after `batches` batches of its epoch must
    hold: the loader's, unless the pass followed a resume on other ranks or workers."""
    position = part.get("position") if isinstance(part, dict) else None
    if isinstance(position, dict) and "history" in position:
        return position.get("batches", position.get("samples"))
    return batches


class EpochSetter(tud.Sampler):
    """An IterableDataset loader's sampler (torch's yields None forever; so does this one)
    that takes set_epoch: EpochLoader reads the epoch from it as from any sampler."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        return itertools.repeat(None)


def check_part(part, epoch: int, position: int, name: str) -> None:
    """Refuse a sampler's or dataset's state that disagrees with the loader's epoch and
    position (a state put together by hand, or from two checkpoints)."""
    if not isinstance(part, dict):
        raise ValueError(f"EpochLoader.load_state_dict: the {name} state must be a dict, got {type(part).__name__}")
    saved = part.get("position")
    if name == "dataset":  # WDSDataset's: None at an epoch's start, else the loader's batch count
        saved = 0 if saved is None else saved.get("batches") if isinstance(saved, dict) else saved
    if part.get("epoch") != epoch or saved != position:
        raise ValueError(f"EpochLoader.load_state_dict: the {name} state (epoch {shown(part.get('epoch'))}, position "
                         f"{shown(saved)}) disagrees with the loader's (epoch {epoch}, position {position}); save and "
                         "load whole states from state_dict()")


@dataclass(frozen=True)
class WorkerPolicy:
    """How many DataLoader workers, and how they are kept and fed."""

    workers: int
    persistent: bool
    prefetch_factor: int | None
    context: object = None


def worker_policy(workers: int | None, persistent_workers: bool | None, prefetch_factor: int | None,
                  multiprocessing_context=None) -> WorkerPolicy:
    """The worker settings make_loader uses: defaults filled in, contradictions refused."""
    if workers is None:
        workers = default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"make_loader: workers must be an int >= 0, got {workers!r}")
    if persistent_workers is None:
        persistent_workers = workers > 0
    elif persistent_workers and workers == 0:
        raise ValueError("make_loader: persistent_workers=True needs workers > 0 (with workers=0 the main "
                         "process loads the data and there is no worker to keep); drop persistent_workers "
                         "or set workers")
    if prefetch_factor is None:
        prefetch_factor = max(2, math.ceil(BATCHES_IN_FLIGHT / workers)) if workers else None
    elif workers == 0:
        raise ValueError("make_loader: prefetch_factor applies to worker processes; with workers=0 there are "
                         "none, so drop prefetch_factor or set workers")
    elif prefetch_factor < 1:
        raise ValueError(f"make_loader: prefetch_factor must be >= 1, got {prefetch_factor}")
    if multiprocessing_context is not None and workers == 0:
        raise ValueError("make_loader: multiprocessing_context applies to worker processes; set workers > 0")
    return WorkerPolicy(workers, persistent_workers, prefetch_factor, multiprocessing_context)


def pin_policy(pin_memory: bool | None, cuda: bool) -> bool:
    """Pin batches for a CUDA target only: for a CPU target pinning only costs a copy."""
    if pin_memory is None:
        return cuda
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("make_loader: pin_memory=True needs CUDA (pinned memory only speeds up copies to a "
                         "GPU, and there is none here); drop pin_memory")
    return bool(pin_memory)


def gpu_decoder(gpu_decode, dataset, device, cuda: bool, train: bool):
    """The batch decoder for gpu_decode (None, False, True or a decoder), or None."""
    if gpu_decode is None or gpu_decode is False:
        return None
    if isinstance(gpu_decode, str) and gpu_decode != "hybrid":
        raise ValueError(f"make_loader: gpu_decode must be True, False, 'hybrid' or a decoder, not {gpu_decode!r}")
    if not cuda and not (device is not None and isinstance(gpu_decode, HybridDecoder)):  # a stand-in engine
        raise ValueError("make_loader: gpu_decode decodes on the GPU and needs device='cuda'")
    if getattr(dataset, "decode", "raw") != "raw" or getattr(dataset, "transform", None) is not None:
        raise ValueError("make_loader: with gpu_decode the workers only read bytes and the GPU decodes and "
                         "transforms them; build the dataset with decode='raw' and no transform")
    if gpu_decode is not True and gpu_decode != "hybrid":
        return gpu_decode
    from .nvjpeg import GPUDecoder
    from .transforms import RandomResizedCrop, ResizeCenterCrop

    engine = GPUDecoder(RandomResizedCrop(224, flip=0.5) if train else ResizeCenterCrop(224), device)
    return HybridDecoder(engine) if gpu_decode == "hybrid" else engine


def warn_if_drop_last_drops_much(loader: EpochLoader, sampler) -> None:
    """Warn when drop_last (the training default) drops a large share of each epoch, or all of it:
    125 images in batches of 32 read 96 per epoch, and fewer than 32 read none, silently. An
    IterableDataset's workers each drop their own partial batch (WDSDataset.batches)."""
    if not loader.drop_last:
        return
    try:
        per_epoch = len(sampler if sampler is not None else loader.dataset)
        kept = len(loader) * loader.batch_size
    except TypeError:  # an IterableDataset without a length
        return
    dropped = per_epoch - kept
    if not dropped or (kept and dropped < DROP_WARN_SHARE * per_epoch):
        return
    what = ("every sample: there is no full batch, so each epoch is empty" if not kept
            else f"{dropped} of {per_epoch} samples ({dropped / per_epoch:.0%}) from every epoch")
    warnings.warn(f"make_loader: drop_last (the training default) drops {what}; use a smaller batch_size, "
                  f"or pass drop_last=False", LoaderWarning, stacklevel=3)


def batch_collate(collate_fn, pin_memory: bool, normalise: Normalise | None, encoded: bool = False,
                  give_back: bool = False):
    """The loader's collate_fn: readers.collate (one shared or pinned buffer) unless one is
    given. With normalise (a CPU target), image batches are converted to normalised float
    where they are made, in the DataLoader workers, in parallel and ahead of the consumer,
    instead of in the main process as each batch is taken; what arrives is what the
    CUDAPrefetcher's CPU fallback would have produced, and it passes through unchanged.
    encoded (gpu_decode): a batch's bytes go in one buffer (readers.buffers.EncodedBatch).
    give_back (workers, pinned): our collates' batches travel as WorkerBatch, whose shared
    memory the pin thread frees once pinned, off the GIL; a given collate_fn's batch may
    hold memory its worker still uses, so it travels as it is."""
    if collate_fn is None:
        ours = (functools.partial(encoded_collate, pin_memory=pin_memory) if encoded
                else functools.partial(collate, pin_memory=pin_memory, normalise=normalise))
        return functools.partial(to_be_pinned, ours) if give_back else ours
    return collate_fn if normalise is None else NormalisedCollate(collate_fn, normalise)


@dataclass(frozen=True)
class Order:
    """How a dataset is walked: the DataLoader's sampler and shuffle arguments, and the
    access pattern to tell its packer reader (None: it has none)."""

    sampler: tud.Sampler | None
    shuffle: bool | None
    access: str | None


def choose_order(dataset, order: str | None, shuffle: bool | None, train: bool, drop_last: bool, seed: int,
                 rank: int, world_size: int, block_size: int = BLOCK_SIZE, window: int = WINDOW) -> Order:
    """The walk make_loader sets up for `order` and `shuffle` (None: by `train`) on this rank."""
    if order is not None and order not in ORDERS:
        raise ValueError(f"make_loader: order must be one of {', '.join(ORDERS)}, not {order!r}")
    if isinstance(dataset, tud.IterableDataset):
        if shuffle or order is not None:
            raise ValueError(f"make_loader: {type(dataset).__name__} is an IterableDataset: it shuffles (and "
                             f"splits shards among ranks and workers) itself; drop shuffle/order and configure "
                             f"the dataset")
        return Order(None, None, None)
    packed = reader_of(dataset) is not None

    def walk(sampler, dataloader_shuffle, random_access: bool) -> Order:
        return Order(sampler, dataloader_shuffle, ("random" if random_access else "sequential") if packed else None)

    if order in ("block", "sequential"):
        if order == "sequential" and shuffle:
            raise ValueError("make_loader: order='sequential' reads in storage order; it cannot also shuffle "
                             "(use order='block' for near-sequential reads with shuffled batches)")
        block_shuffle = order == "block" and (train if shuffle is None else shuffle)
        return walk(BlockShuffleSampler(dataset, block_size, window, shuffle=block_shuffle, seed=seed, rank=rank,
                                        world_size=world_size), None, False)
    if shuffle is None:
        shuffle = train or order == "random"
    # Packed data: the permutation, read ahead. A FolderDataset takes the same seeded permutation
    # (no hints): the same order as its packed copy. Unshuffled (evaluation), index order,
    # DistributedSampler's share of it under DDP: either way resumable mid-epoch.
    if packed or isinstance(dataset, ReaderDataset):
        return walk(ShuffleSampler(dataset, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                                   drop_last=drop_last), None, shuffle)
    if world_size > 1:
        return walk(tud.DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                           drop_last=drop_last), None, shuffle)
    return walk(None, shuffle, shuffle)


def make_loader(dataset, batch_size: int, *, device=None, train: bool = True, workers: int | None = None,
                shuffle: bool | None = None, drop_last: bool | None = None, pin_memory: bool | None = None,
                persistent_workers: bool | None = None, prefetch_factor: int | None = None,
                multiprocessing_context=None, collate_fn=None, worker_init_fn=None, seed: int = 0,
                mean=None, std=None, channels_last: bool = False, dtype=torch.float32,
                gpu_decode=None, stats=False, order: str | None = None, block_size: int = BLOCK_SIZE,
                window: int = WINDOW):
    """A DataLoader (or CUDAPrefetcher over one) for `dataset`, set up for training speed.

    Args:
        device: None gives the loader's uint8 batches as they are; "cuda[:N]" returns a
            readers.CUDAPrefetcher yielding normalised float batches on that GPU; "cpu"
            returns the prefetcher's CPU fallback (same outputs, on the CPU), with the
            conversion done in the DataLoader workers as each batch is collated (float
            batches are 4x the uint8 ones: None is for a consumer that converts itself).
        train: shuffle and drop the last partial batch (each can be overridden).
        workers: DataLoader processes; default: the cores available (affinity-aware),
            divided by the local ranks (readers.ranks.local_world_size).
        seed: the shuffle seed (the same on every rank).
        mean, std, channels_last, dtype: passed to CUDAPrefetcher.
        gpu_decode: decode JPEGs on the GPU with nvJPEG (needs torchvision): True for
            RandomResizedCrop(224, flip=0.5) / ResizeCenterCrop(224) by `train`, or a
            readers.nvjpeg.GPUDecoder; "hybrid" to split each batch between the workers
            and nvJPEG, tuned online (readers.hybrid), or a readers.hybrid.HybridDecoder.
            The dataset must yield raw bytes (decode="raw", no transform).
        stats: True, or a dict of LoaderStats options, to wrap the result in LoaderStats.
        order: how a map-style dataset is walked. "random": a permutation per epoch (the
            default when shuffling; over packed data readers.ShuffleSampler, which reads
            ahead); "block": readers.BlockShuffleSampler(block_size, window),
            near-sequential reads with mixed batches, for cold or remote storage;
            "sequential": storage order. Default: "random" if shuffling, else index order.

    Returns an EpochLoader; wrapped in a CUDAPrefetcher when device is given, and in
    LoaderStats when stats is; all three iterate the same batches.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"make_loader: batch_size must be a positive int, got {batch_size!r}")
    policy = worker_policy(workers, persistent_workers, prefetch_factor, multiprocessing_context)
    target = None if device is None else resolve_device(device, "make_loader")
    cuda = target is not None and target.type == "cuda"
    decoder = gpu_decoder(gpu_decode, dataset, target, cuda, train)
    pin = pin_policy(pin_memory, cuda)
    drop_last = train if drop_last is None else drop_last
    rank, world_size = world()
    walk = choose_order(dataset, order, shuffle, train, drop_last, seed, rank, world_size, block_size, window)
    if walk.access is not None:  # random: read exactly each record; sequential: let the kernel read ahead
        reader_of(dataset).advise(walk.access)

    # A CPU target's batches are normalised as they are made, in the workers (see batch_collate).
    cpu_normalise = Normalise(mean, std, dtype, channels_last) if target is not None and not cuda else None
    collate = hybrid_collate(decoder, policy.workers, pin, collate_fn) or batch_collate(
        collate_fn, pin and policy.workers == 0, cpu_normalise, decoder is not None,
        give_back=pin and policy.workers > 0)
    loader = epoch_loader(dataset, batch_size, walk, policy, pin, drop_last, collate, worker_init_fn)
    warn_if_drop_last_drops_much(loader, walk.sampler)  # here: its stacklevel names make_loader's caller
    return wrapped_loader(loader, target, decoder, stats, mean=mean, std=std, channels_last=channels_last, dtype=dtype)


def epoch_loader(dataset, batch_size: int, walk: Order, policy: WorkerPolicy, pin: bool, drop_last: bool,
                 collate_fn, worker_init_fn) -> EpochLoader:
    """The DataLoader make_loader sets up: its walk, workers, pinning and collate."""
    return EpochLoader(
        dataset, batch_size=batch_size, shuffle=walk.shuffle, sampler=walk.sampler, num_workers=policy.workers,
        collate_fn=collate_fn, pin_memory=pin, drop_last=drop_last,
        worker_init_fn=(functools.partial(worker_init, rank=process_rank(), user_init=worker_init_fn)
                        if policy.workers else None),
        multiprocessing_context=policy.context, persistent_workers=policy.persistent,
        prefetch_factor=policy.prefetch_factor)


def wrapped_loader(loader: EpochLoader, target, decoder, stats, **normalise):
    """The loader as make_loader returns it: behind a CUDAPrefetcher (normalise: its mean, std,
    channels_last and dtype) when there is a target device, and in LoaderStats when stats asks."""
    result = loader
    if target is not None:
        result = CUDAPrefetcher(loader, target, gpu_decode=decoder, **normalise)
    if stats:
        result = LoaderStats(result, **(stats if isinstance(stats, dict) else {}))
    return result
