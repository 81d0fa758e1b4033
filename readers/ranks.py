"""Who this process is among the training processes, and how many share its machine.

One place answers "which rank of how many, which DataLoader worker of how many" for
make_loader, the samplers and WDSDataset, as webdataset's pytorch_worker_info does:
torch.distributed when a process group is initialised, else the RANK and WORLD_SIZE
environment variables that torchrun and SLURM launchers set (also the seam tests use),
else one rank.

Under Hugging Face Accelerate, the data is one rank's: accelerator.prepare() deals a
loader's batches among the processes itself (docs/frameworks.md), so a share of the data
dealt again would leave each rank 1/N of its share.
"""
from __future__ import annotations

import os
import sys
import threading

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
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        try:
            rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        except ValueError as exc:
            raise ValueError(f"RANK and WORLD_SIZE must be integers ({exc})") from exc
        if not 0 <= rank < world_size:
            raise ValueError(f"environment has RANK={rank}, WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE")
    if world_size > 1 and accelerate_runs():
        raise RuntimeError(single_accelerate_message(rank, world_size))
    return rank, world_size


def single_accelerate_message(rank: int, world_size: int) -> str:
    """Why packer stops where a launcher started several processes and Accelerate runs one."""
    kind = getattr(accelerate_state().get("distributed_type"), "value", accelerate_state().get("distributed_type"))
    return (f"this is rank {rank} of WORLD_SIZE={world_size} (a launcher such as torchrun started "
            f"{world_size} processes), but the Accelerator here runs 1 process (distributed_type {kind}): the "
            "processes would train apart, with no gradient sync, each on its own share of the data. On CPUs, "
            "make it with Accelerator(cpu=True, ...); on GPUs, check that each process sees its device "
            "(docs/frameworks.md)")


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
    """Training processes on this machine, at least 1: torchrun's LOCAL_WORLD_SIZE; else,
    where a launcher started local ranks without it (Lightning's sets LOCAL_RANK and
    WORLD_SIZE only; its ddp_spawn initialises torch.distributed), the world size over
    the node count SLURM gives (one node without it: on several, too few workers, never
    too many)."""
    local = positive_env("LOCAL_WORLD_SIZE")
    if local is not None:
        return local
    if dist.is_available() and dist.is_initialized():
        processes = dist.get_world_size()
    elif "LOCAL_RANK" in os.environ:
        processes = positive_env("WORLD_SIZE") or 1
    else:
        return 1
    return max(1, processes // (positive_env("SLURM_NNODES") or 1))


def positive_env(name: str) -> int | None:
    """The environment variable `name` as a positive int, else None."""
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


_thread_worker = threading.local()  # .of: (worker id, count) of a thread worker (as_worker)


def as_worker(worker_id: int, workers: int) -> None:
    """Make worker() answer (worker_id, workers) on this thread: a thread that reads a
    stream as one of `workers` DataLoader workers would (readers.thread_streams)."""
    _thread_worker.of = (worker_id, workers)


def worker() -> tuple[int, int]:
    """(worker id, worker count) of the DataLoader worker this runs in (or the thread worker,
    as_worker); (0, 1) outside one."""
    own = getattr(_thread_worker, "of", None)
    if own is not None:
        return own
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)

