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
- for shuffled packed data a ShuffleSampler (DistributedSampler's permutation and rank
  shares, with the next records hinted to the kernel so cold random reads overlap), else
  DistributedSampler when torch.distributed is initialised (an IterableDataset splits
  itself), or with order="block" a BlockShuffleSampler, which splits across ranks too;
  an epoch counter that advances by itself so shuffles differ per epoch;
- the reader told the access pattern (random: read exactly each record; block or
  sequential: let the kernel read ahead);
- drop_last for training, so every step sees a full batch (BatchNorm, DDP);
- a collate that stacks uint8 images into one shared-memory/pinned buffer.
"""
from __future__ import annotations

import functools
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data as tud

from packer.pack import available_cores

from .collate import collate
from .gpu import CUDAPrefetcher
from .sampler import BLOCK_SIZE, WINDOW, BlockShuffleSampler, ShuffleSampler, reader_of
from .stats import LoaderStats

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
# Aim for this many batches ready or in flight across all workers: enough to absorb a
# slow batch, without each worker holding many batches of shared memory.
BATCHES_IN_FLIGHT = 8
ORDERS = ("random", "block", "sequential")


def distributed() -> tuple[int, int]:
    """(rank, world size) of torch.distributed, or (0, 1) when it is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_workers() -> int:
    """Cores available to this process, divided among the ranks on this machine."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, available_cores() // max(1, local_ranks))


def worker_init(worker_id: int, rank: int = 0, user_init=None) -> None:
    """Runs in each worker: one thread per library, per-worker and per-rank seeds."""
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


class Loader(tud.DataLoader):
    """A DataLoader whose epoch advances on each pass (for its sampler and dataset).

    set_epoch(n) makes the next pass epoch n; without calls, passes are epochs 0, 1, 2...
    """

    _next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = int(epoch)

    def __iter__(self):
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        for target in (self.sampler, self.dataset):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
        return super().__iter__()


def _device_type(device) -> str | None:
    if device is None:
        return None
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"make_loader: device must be None, 'cpu', 'cuda' or 'cuda:N', not {str(device)!r}")
    return kind


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
            returns the prefetcher's CPU fallback (same outputs, on the CPU).
        train: shuffle and drop the last partial batch (each can be overridden).
        workers: DataLoader processes; default: the cores available (affinity-aware),
            divided by LOCAL_WORLD_SIZE.
        seed: the shuffle seed (the same on every rank).
        mean, std, channels_last, dtype: passed to CUDAPrefetcher.
        gpu_decode: decode JPEGs on the GPU with nvJPEG (needs torchvision): True for
            RandomResizedCrop(224) / CenterCrop(224) by `train`, or a readers.nvjpeg.GPUDecoder.
            The dataset must yield raw bytes (decode="raw", no transform).
        stats: True, or a dict of LoaderStats options, to wrap the result in LoaderStats.
        order: how a map-style dataset is walked. "random": a permutation per epoch (the
            default when shuffling; over packed data readers.ShuffleSampler, which reads
            ahead); "block": readers.BlockShuffleSampler(block_size, window),
            near-sequential reads with mixed batches, for cold or remote storage;
            "sequential": storage order. Default: "random" if shuffling, else index order.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"make_loader: batch_size must be a positive int, got {batch_size!r}")
    if workers is None:
        workers = default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"make_loader: workers must be an int >= 0, got {workers!r}")
    cuda = _device_type(device) == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"make_loader: device={str(device)!r} but CUDA is not available (torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                           f"pass device=None or 'cpu'")
    if gpu_decode is not None and gpu_decode is not False and not cuda:
        raise ValueError("make_loader: gpu_decode decodes on the GPU and needs device='cuda'")
    if gpu_decode not in (None, False) and (getattr(dataset, "decode", "raw") != "raw"
                                            or getattr(dataset, "transform", None) is not None):
        raise ValueError("make_loader: with gpu_decode the workers only read bytes and the GPU decodes and "
                         "transforms them; build the dataset with decode='raw' and no transform")
    if gpu_decode is True:
        from .nvjpeg import GPUDecoder
        from .transforms import CenterCrop, RandomResizedCrop

        gpu_decode = GPUDecoder(RandomResizedCrop(224) if train else CenterCrop(224), device)
    elif gpu_decode is False:
        gpu_decode = None

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
    if pin_memory is None:
        pin_memory = cuda
    elif pin_memory and not torch.cuda.is_available():
        raise ValueError("make_loader: pin_memory=True needs CUDA (pinned memory only speeds up copies to a "
                         "GPU, and there is none here); drop pin_memory")

    rank, world = distributed()
    iterable = isinstance(dataset, tud.IterableDataset)
    sampler = None
    if order is not None and order not in ORDERS:
        raise ValueError(f"make_loader: order must be one of {', '.join(ORDERS)}, not {order!r}")
    if iterable:
        if shuffle or order is not None:
            raise ValueError(f"make_loader: {type(dataset).__name__} is an IterableDataset: it shuffles (and "
                             f"splits shards among ranks and workers) itself; drop shuffle/order and configure "
                             f"the dataset")
        shuffle = None
    elif order in ("block", "sequential"):
        if order == "sequential" and shuffle:
            raise ValueError("make_loader: order='sequential' reads in storage order; it cannot also shuffle "
                             "(use order='block' for near-sequential reads with shuffled batches)")
        block_shuffle = order == "block" and (train if shuffle is None else shuffle)
        sampler = BlockShuffleSampler(dataset, block_size, window, shuffle=block_shuffle, seed=seed, rank=rank,
                                      world_size=world)
        shuffle = None
    else:
        if shuffle is None:
            shuffle = train or order == "random"
        if shuffle and reader_of(dataset) is not None:  # packed data: the permutation, read ahead
            sampler = ShuffleSampler(dataset, seed=seed, rank=rank, world_size=world,
                                     drop_last=train if drop_last is None else drop_last)
            shuffle = None
        elif world > 1:
            sampler = tud.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                             drop_last=train if drop_last is None else drop_last)
            shuffle = None
    if drop_last is None:
        drop_last = train
    reader = None if iterable else reader_of(dataset)
    if reader is not None:  # read exactly each record, or let the kernel read ahead
        permuted = shuffle or (isinstance(sampler, (tud.DistributedSampler, ShuffleSampler)) and sampler.shuffle)
        reader.advise("random" if permuted and not isinstance(sampler, BlockShuffleSampler) else "sequential")
    if collate_fn is None:
        collate_fn = functools.partial(collate, pin_memory=pin_memory and workers == 0)

    loader = Loader(
        dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, num_workers=workers,
        collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last,
        worker_init_fn=functools.partial(worker_init, rank=rank, user_init=worker_init_fn) if workers else None,
        multiprocessing_context=multiprocessing_context, persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor)
    result = loader
    if device is not None:
        result = CUDAPrefetcher(loader, device, mean=mean, std=std, channels_last=channels_last, dtype=dtype,
                                gpu_decode=gpu_decode)
    if stats:
        result = LoaderStats(result, **(stats if isinstance(stats, dict) else {}))
    return result
