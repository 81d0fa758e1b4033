"""Who this process is among the training processes, and how work is shared among them.

One place answers "which rank of how many, which DataLoader worker of how many" for
make_loader, the samplers and WDSDataset, as webdataset's pytorch_worker_info does:
torch.distributed when a process group is initialised, else the RANK and WORLD_SIZE
environment variables that torchrun and SLURM launchers set (also the seam tests use),
else one rank. deal() is the one rule for splitting an epoch's work among ranks.

Under Hugging Face Accelerate, the data is one rank's: accelerator.prepare() deals a
loader's batches among the processes itself (docs/frameworks.md), so a share of the data
dealt again would leave each rank 1/N of its share.
"""
from __future__ import annotations

import heapq
import os
import sys
from typing import Any, Iterable, Sequence

import torch.distributed as dist
import torch.utils.data


def check_rank(rank: int | None, world_size: int | None, who: str) -> None:
    """Refuse a half-given or out-of-range (rank, world_size) pair; both None means "ask world()"."""
    if (rank is None) != (world_size is None) or (world_size is not None and not 0 <= rank < world_size):
        raise ValueError(f"{who}: pass rank and world_size together, with 0 <= rank < world_size "
                         f"(got rank={rank}, world_size={world_size})")


def world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): the given pair, else torch.distributed's, else RANK/WORLD_SIZE, else (0, 1)."""
    if rank is not None:
        return rank, world_size
    if accelerate_shards():
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError as exc:
        raise ValueError(f"RANK and WORLD_SIZE must be integers ({exc})") from exc
    if not 0 <= rank < world_size:
        raise ValueError(f"environment has RANK={rank}, WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE")
    return rank, world_size


def accelerate_shards() -> bool:
    """Whether Accelerate runs more than one process here, so that its prepare() shards the loaders."""
    return accelerate_state().get("num_processes", 1) > 1


def accelerate_runs() -> bool:
    """Whether an Accelerator (or PartialState) has been made in this process, on any number of processes."""
    return bool(accelerate_state())


def accelerate_state() -> dict:
    """Accelerate's shared state, which exists once an Accelerator (or PartialState) is made;
    Accelerate is never imported for this: a process that has not imported it is not using it."""
    state = sys.modules.get("accelerate.state")
    return getattr(getattr(state, "PartialState", None), "_shared_state", None) or {}


def process_rank() -> int:
    """This process's rank among the training processes, whoever shards the data (the seed
    of its workers' augmentations: ranks must not draw the same ones)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", 0))
    except ValueError:
        return 0


def local_world_size() -> int:
    """Training processes on this machine (torchrun's LOCAL_WORLD_SIZE), at least 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def worker() -> tuple[int, int]:
    """(worker id, worker count) of the DataLoader worker this runs in; (0, 1) outside one."""
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def deal(items: Iterable[tuple[Any, int]], ranks: int) -> tuple[list[Sequence], list[int]]:
    """Deal (item, size) pairs, in the order given, whole to `ranks` ranks, each to the rank
    holding the least so far (the lowest rank on a tie); returns each rank's items (a list,
    or () for none) and each rank's total size. Every rank computes the same deal from the same order, so shares are
    disjoint without any communication; max(load) - load[rank] is what a rank must pad to
    keep step counts equal (DDP hangs otherwise)."""
    # A rank with no item keeps the shared empty tuple: on many ranks (a resume replays a deal to
    # each world size a state names) a list apiece would cost more than the deal.
    owned: list[Sequence] = [()] * ranks
    load = [0] * ranks
    least = [(0, rank) for rank in range(ranks)]  # a heap: (load, rank), so a tie goes to the lowest rank
    for item, size in items:
        rank = least[0][1]
        if not owned[rank]:
            owned[rank] = []
        owned[rank].append(item)
        load[rank] += size
        heapq.heapreplace(least, (load[rank], rank))
    return owned, load
