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
  for a readers.Mix its MixSampler (the weights' schedule); one row each in SAMPLERS;
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
from .sampler import BLOCK_SIZE, STATE_VERSION, WINDOW, BlockShuffleSampler, ShuffleSampler, check_state, checked_count
from .sampler import reader_of
from .mix import Mix, MixSampler
from .resume_state import check_part, sampler_position, sampler_state, stream_batches
from .stats import LoaderStats, LoaderWarning
from .threads import WORKER_KINDS, ThreadBatches

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
        resume = getattr(self.dataset, "resume", None)  # a WDSDataset's readers._wds_resume.StreamResume
        pending = self.num_workers and resume is not None and self.dataset.plan_pending_pass(self.num_workers)
        batches = super().__iter__()
        if pending:  # the workers took their copies, and the pass's plan: later ones start afresh
            resume.pending = None
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
        """Whether a pass has begun and not ended. One that has handed out every batch, its end
        not yet seen (Lightning saves there, at an epoch's end), is over: a resume starts the next epoch."""
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


class ThreadLoader(EpochLoader, ThreadBatches):
    """An EpochLoader whose batches thread workers make (readers.threads): the same
    sampler, collate, position and state as with DataLoader worker processes."""


class EpochSetter(tud.Sampler):
    """An IterableDataset loader's sampler (torch's yields None forever; so does this one)
    that takes set_epoch: EpochLoader reads the epoch from it as from any sampler."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        return itertools.repeat(None)


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


def refuse_gpu_decode_of_a_mix(gpu_decode, dataset) -> None:
    if gpu_decode not in (None, False) and isinstance(dataset, Mix):
        raise ValueError("make_loader: gpu_decode batches (bytes, label) pairs and a mixture's samples also name "
                         "their source; decode in the workers (decode= and transform on each source), or mix "
                         "without gpu_decode")


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


@dataclass(frozen=True)
class Walk:
    """What make_loader asks of a sampler row: the dataset, the order and shuffle asked
    (shuffle already resolved by `train` where None), and this rank's place."""

    dataset: object
    order: str | None
    shuffle: bool
    drop_last: bool
    seed: int
    rank: int
    world_size: int
    block_size: int
    window: int
    keyed: bool = True  # packer's samplers hand out keyed indexes (readers.keyed)

    def packed(self) -> bool:
        return reader_of(self.dataset) is not None

    def access(self, random_access: bool) -> str | None:
        return ("random" if random_access else "sequential") if self.packed() else None


def mix_walk(w: Walk) -> Order:
    """A readers.Mix: its sources' passes in `order` (random when shuffling, else index order), by weight."""
    order = w.order or ("random" if w.shuffle else "sequential")
    return Order(MixSampler(w.dataset, order, w.block_size, w.window, rank=w.rank, world_size=w.world_size,
                            drop_last=w.drop_last, keyed=w.keyed), None, "random" if order == "random" else "sequential")


def block_walk(w: Walk) -> Order:
    """Shuffled blocks of storage order ("block"), or storage order itself ("sequential")."""
    sampler = BlockShuffleSampler(w.dataset, w.block_size, w.window, shuffle=w.order == "block" and w.shuffle,
                                  seed=w.seed, rank=w.rank, world_size=w.world_size, keyed=w.keyed)
    return Order(sampler, None, w.access(False))


def shuffle_walk(w: Walk) -> Order:
    """Packed data: the permutation, read ahead; a FolderDataset the same seeded permutation (no hints), as
    its packed copy. Unshuffled (evaluation), index order. Either way resumable mid-epoch."""
    sampler = ShuffleSampler(w.dataset, shuffle=w.shuffle, seed=w.seed, rank=w.rank, world_size=w.world_size,
                             drop_last=w.drop_last, keyed=w.keyed)
    return Order(sampler, None, w.access(w.shuffle))


def distributed_walk(w: Walk) -> Order:
    """Any other dataset under DDP: DistributedSampler's share."""
    return Order(tud.DistributedSampler(w.dataset, num_replicas=w.world_size, rank=w.rank, shuffle=w.shuffle,
                                        seed=w.seed, drop_last=w.drop_last), None, w.access(w.shuffle))


def plain_walk(w: Walk) -> Order:
    """Any other dataset on one process: the DataLoader's own sampler."""
    return Order(None, w.shuffle, w.access(w.shuffle))


# The samplers make_loader sets up, one row each: the first row whose test takes the walk
# builds it. A new order or kind of dataset is one row here (and its sampler's module).
SAMPLERS = (
    ("mix", lambda w: isinstance(w.dataset, Mix), mix_walk),
    ("block", lambda w: w.order in ("block", "sequential"), block_walk),
    ("random", lambda w: w.packed() or isinstance(w.dataset, ReaderDataset), shuffle_walk),
    ("distributed", lambda w: w.world_size > 1, distributed_walk),
    ("plain", lambda w: True, plain_walk),
)


def choose_order(dataset, order: str | None, shuffle: bool | None, train: bool, drop_last: bool, seed: int,
                 rank: int, world_size: int, block_size: int = BLOCK_SIZE, window: int = WINDOW,
                 keyed: bool = True) -> Order:
    """The walk make_loader sets up for `order` and `shuffle` (None: by `train`) on this rank;
    keyed: packer's samplers hand out keyed indexes (readers.keyed)."""
    if order is not None and order not in ORDERS:
        raise ValueError(f"make_loader: order must be one of {', '.join(ORDERS)}, not {order!r}")
    if isinstance(dataset, tud.IterableDataset):
        if shuffle or order is not None:
            raise ValueError(f"make_loader: {type(dataset).__name__} is an IterableDataset: it shuffles (and "
                             f"splits shards among ranks and workers) itself; drop shuffle/order and configure "
                             f"the dataset")
        return Order(None, None, None)
    if order == "sequential" and shuffle:
        raise ValueError("make_loader: order='sequential' reads in storage order; it cannot also shuffle "
                         "(use order='block' for near-sequential reads with shuffled batches)")
    if shuffle is None:  # block shuffles its blocks when training; random always shuffles
        shuffle = train if order in ("block", "sequential") else train or order == "random"
    walk = Walk(dataset, order, bool(shuffle), drop_last, seed, rank, world_size, block_size, window, keyed)
    return next(build(walk) for _, takes, build in SAMPLERS if takes(walk))


def readers_to_advise(dataset) -> list:
    """The packer readers behind a dataset (each source's, for a Mix)."""
    found = [reader_of(d) for d in (dataset.sources if isinstance(dataset, Mix) else [dataset])]
    return [r for r in found if r is not None]


def make_loader(dataset, batch_size: int, *, device=None, train: bool = True, workers: int | None = None,
                shuffle: bool | None = None, drop_last: bool | None = None, pin_memory: bool | None = None,
                persistent_workers: bool | None = None, prefetch_factor: int | None = None,
                multiprocessing_context=None, collate_fn=None, worker_init_fn=None, seed: int = 0,
                mean=None, std=None, channels_last: bool = False, dtype=torch.float32,
                gpu_decode=None, stats=False, order: str | None = None, block_size: int = BLOCK_SIZE,
                window: int = WINDOW, keyed: bool = True, worker_kind: str = "processes"):
    """A DataLoader (or CUDAPrefetcher over one) for `dataset`, set up for training speed.

    Args:
        device: None gives the loader's uint8 batches as they are; "cuda[:N]" returns a
            readers.CUDAPrefetcher yielding normalised float batches on that GPU; "cpu"
            returns the prefetcher's CPU fallback (same outputs, on the CPU), with the
            conversion done in the DataLoader workers as each batch is collated (float
            batches are 4x the uint8 ones: None is for a consumer that converts itself).
        train: shuffle and drop the last partial batch (each can be overridden).
        workers: DataLoader processes (or threads); default: the cores available (affinity-
            aware), divided by the local ranks (readers.ranks.local_world_size).
        seed: the run's seed, the same on every rank: of the shuffle and (keyed) augmentation.
        mean, std, channels_last, dtype: passed to CUDAPrefetcher.
        gpu_decode: decode JPEGs on the GPU with nvJPEG (needs torchvision): True for
            RandomResizedCrop(224, flip=0.5) / ResizeCenterCrop(224) by `train`, or a
            readers.nvjpeg.GPUDecoder; "hybrid" to split each batch between the workers
            and nvJPEG, tuned online (readers.hybrid), or a readers.hybrid.HybridDecoder.
            The dataset must yield raw bytes (decode="raw", no transform).
        stats: True, or a dict of LoaderStats options, to wrap the result in LoaderStats.
        order: how a map-style dataset is walked: "random", a permutation per epoch (readers.
            ShuffleSampler, reading ahead); "block", readers.BlockShuffleSampler(block_size,
            window), near-sequential reads with mixed batches for cold or remote storage;
            "sequential", storage order. Default: "random" if shuffling, else index order.
        keyed: packer's transforms draw from a generator keyed to (seed, epoch, sample), the
            same on any ranks, workers or resume (docs/reproducibility.md); False: each worker's own.
        worker_kind: "processes" (DataLoader workers), "threads" (in one background process per
            rank) or "threads-inline" (in this one); the same state either way (docs/readers.md).

    Returns an EpochLoader; wrapped in a CUDAPrefetcher when device is given, and in
    LoaderStats when stats is; all three iterate the same batches.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"make_loader: batch_size must be a positive int, got {batch_size!r}")
    refuse_gpu_decode_of_a_mix(gpu_decode, dataset)  # before the device: say what to change first
    threads = thread_workers(worker_kind, dataset, workers, persistent_workers, worker_init_fn)
    policy = worker_policy(0 if threads else workers, persistent_workers, None if threads else prefetch_factor,
                           None if threads else multiprocessing_context)
    target = None if device is None else resolve_device(device, "make_loader")
    cuda = target is not None and target.type == "cuda"
    decoder = gpu_decoder(gpu_decode, dataset, target, cuda, train)
    pin = pin_policy(pin_memory, cuda)
    drop_last = train if drop_last is None else drop_last
    walk = advised_order(dataset, order, shuffle, train, drop_last, seed, block_size, window, keyed)
    cpu_normalise = Normalise(mean, std, dtype, channels_last) if target is not None and not cuda else None  # workers'
    collate = hybrid_collate(decoder, policy.workers, pin, collate_fn) or batch_collate(
        collate_fn, pin and policy.workers == 0 and worker_kind != "threads", cpu_normalise, decoder is not None,
        give_back=pin and policy.workers > 0)
    loader = epoch_loader(dataset, batch_size, walk, policy, pin, drop_last, collate, worker_init_fn,
                          ThreadLoader if threads else EpochLoader)
    set_threads(loader, threads, worker_kind, pin, prefetch_factor, multiprocessing_context)
    getattr(dataset, "batching", lambda *_: None)(batch_size, drop_last, loader.num_workers)  # a Mix over streams
    warn_if_drop_last_drops_much(loader, walk.sampler)  # here: its stacklevel names make_loader's caller
    return wrapped_loader(loader, target, decoder, stats, mean=mean, std=std, channels_last=channels_last, dtype=dtype)


def advised_order(dataset, order, shuffle, train: bool, drop_last: bool, seed: int, block_size: int, window: int,
                  keyed: bool) -> Order:
    """choose_order on this rank, with the readers told how it reads: random, exactly each
    record; sequential, letting the kernel read ahead."""
    rank, world_size = world()
    walk = choose_order(dataset, order, shuffle, train, drop_last, seed, rank, world_size, block_size, window,
                        keyed)
    if walk.access is not None:
        for reader in readers_to_advise(dataset):
            reader.advise(walk.access)
    return walk


def set_threads(loader, threads: int, worker_kind: str, pin: bool, prefetch_factor, context) -> None:
    """Make a ThreadLoader's batches with `threads` threads (readers.threads); 0: processes'."""
    if not threads:
        return
    loader.threads, loader.kind, loader.pin = threads, worker_kind, pin and worker_kind == "threads"
    if isinstance(loader.dataset, tud.IterableDataset):
        loader.num_workers = threads  # each thread reads the stream as a worker: the state counts them
    loader.prefetch = max(1, prefetch_factor * threads if prefetch_factor else max(BATCHES_IN_FLIGHT, threads))
    loader.context = context


def thread_workers(worker_kind: str, dataset, workers: int | None, persistent_workers, worker_init_fn) -> int:
    """The thread count for a threads worker_kind (0 for processes), checked."""
    if worker_kind not in WORKER_KINDS:
        raise ValueError(f"make_loader: worker_kind must be one of {', '.join(WORKER_KINDS)}, not {worker_kind!r}")
    if worker_kind == "processes":
        return 0
    if isinstance(dataset, tud.IterableDataset) and worker_kind == "threads-inline":
        raise ValueError(f"make_loader: worker_kind='threads-inline' reads map-style datasets by index; "
                         f"{type(dataset).__name__} is an IterableDataset, so use worker_kind='threads' or "
                         f"'processes' (or readers.WDSMapDataset over the same shards)")
    threads = default_workers() if workers is None else workers
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"make_loader: with worker_kind={worker_kind!r}, workers is the number of threads and "
                         f"must be an int >= 1, got {workers!r}")
    for name, given in (("persistent_workers", persistent_workers), ("worker_init_fn", worker_init_fn)):
        if given:
            raise ValueError(f"make_loader: {name} applies to worker processes; with worker_kind={worker_kind!r} "
                             f"there are none, so drop it")
    return threads


def epoch_loader(dataset, batch_size: int, walk: Order, policy: WorkerPolicy, pin: bool, drop_last: bool,
                 collate_fn, worker_init_fn, loader_class=None) -> EpochLoader:
    """The DataLoader make_loader sets up: its walk, workers, pinning and collate."""
    return (loader_class or EpochLoader)(
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
