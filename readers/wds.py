"""WDSDataset: streams WebDataset tar shards (packer's or any tool's) across DDP ranks and workers.

A worker's stream is a chain of stages. Plan: one epoch is planned from the shard list
alone, shards ordered (a permutation seeded by (seed, epoch) when shuffling), their samples
cut into equal shares for the ranks, then for the DataLoader workers (here, with
readers.wds_elastic and readers._stream). Shards and samples: the worker's shards opened in
order and their samples read and checked (readers._wds_read); a local packer folder's shard
samples are read by its index (one pread per image, no tar header parsed), any other shard,
or a packer shard the index does not describe, is parsed. Shuffle: the per-worker buffer
(readers._wds_shuffle). Decode: the conversion to (image, label). The resume state is its
own object (readers._wds_resume.StreamResume).

Resuming (docs/resume.md): each worker's stream is fixed by (seed, epoch, rank, worker,
workers), the buffer's draws included, so a position in it is a count of samples
yielded. To start a stream after its first k samples, the buffer's draws are replayed
over sample ordinals alone (no data), which tells which earlier samples the buffer still
holds and where reading resumes: only the shards holding those samples, or samples from
that point on, are read again; every other shard already consumed is skipped unread.
"""
from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import warnings
from typing import Iterator

import torch.distributed
import torch.utils.data

from packer.errors import CorruptDataError
from packer.formats import current_identity, wds

from ._dataset import PackedDataset
from ._stream import Task, cut, stream_sizes
from ._wds_read import check_replaced, count_or_skip, index_reader, shard_samples
from ._wds_resume import StreamResume, fingerprint
from ._wds_shuffle import samples_after, shuffled, stream_rng  # noqa: F401 (shuffled: benchmarks.resume's)
from ._wds_source import index_file_of, packed_folder, remote_of, resolve
from .decode import DECODE_MODES, MAX_PIXELS, checked_max_pixels, decode
from .heap import keep_heap_in_worker
from .ranks import accelerate_runs, check_rank, worker, world
from .wds_elastic import rank_plan, shard_order, share

ON_ERROR = ("fail", "skip")  # the words of packer pack --on-error
# Accepted for code written before the two vocabularies were one.
ON_ERROR_ALIASES = {"raise": "fail"}


# Accelerate's use_stateful_dataloader=True rebuilds the loader as torchdata's StatefulDataLoader,
# fed from rank 0: it corrects the saved batch count for its look-ahead but not the workers'
# stream positions (one batch ahead on 2 ranks); every process writes the one dl_state_dict.bin,
# and rank 1's, never advanced, can win; a state saved at an epoch's end sets that epoch again
# in the workers, which replay it. The first two cannot be put right from inside the dataset,
# so the combination is refused on any number of processes (one that resumed on 1 and not on 2
# would be a trap).
ACCELERATE_STATEFUL = (
    "WDSDataset.state_dict: Hugging Face Accelerate runs here, and its stateful loader "
    "(DataLoaderConfiguration(use_stateful_dataloader=True)) does not resume a WDSDataset exactly: it saves "
    "the workers' streams a batch past the ones trained on, every process writes the same dl_state_dict.bin "
    "(rank 1's stale state can win), and a state saved at an epoch's end replays that epoch. "
    "Set use_stateful_dataloader=False and resume an epoch with loader.set_epoch(epoch) and "
    "accelerator.skip_first_batches(loader, steps) (docs/frameworks.md)")


class WDSDataset(torch.utils.data.IterableDataset):
    """Iterates (image, label) over shards, each sample once per epoch across ranks x workers.

    path_or_urls: a `packer pack --to wds` folder (its index gives counts and classes),
    a folder of .tar/.tgz shards, one shard, a brace pattern (`shard-{000000..000009}.tar`)
    or a list of shard paths. Without a packer index, the constructor counts samples by
    scanning every shard once (headers only for uncompressed tar); workers inherit the counts.

    Distribution: the rank and world size come from rank=/world_size=, else from
    torch.distributed when it is initialised, else from the RANK and WORLD_SIZE
    environment variables. Each epoch, the shards' samples, in epoch order, are cut into
    equal contiguous shares, one per rank (a shard shared by two ranks where a share ends
    inside it). Padding rule: every rank yields exactly len(self) samples, ceil(samples /
    ranks), the same every epoch; the last ranks' shortfall (ranks - 1 samples at most)
    repeats the epoch's first samples, as DistributedSampler repeats indices. Nothing is
    dropped: every sample is yielded once per epoch, and at most ranks - 1 of them twice.
    A rank's samples are then cut into one run per DataLoader worker, equal to within one
    sample (stream_sizes), a shard shared by two workers where a run ends inside it. Each
    worker batches its own run, so with the same runs on every rank, every rank makes the
    same number of batches, and DDP never hangs.

    shuffle: buffer size per worker (0: shards and samples in stored order). With
    shuffle > 0, set_epoch(n) changes the shard order, the rank/worker assignment and
    the buffer's draws, all derived from (seed, epoch). Call set_epoch before iterating
    a DataLoader (readers.make_loader does it for you); the epoch lives in shared memory,
    so persistent DataLoader workers see it too.

    check_crc: packer's shards carry a `<key>.json` member with the image's checksum (and,
    in newer packs, its label); each sample is checked against it, as the map readers
    check theirs, and a mismatch is a CorruptDataError naming the shard, key and path.
    Samples without that member (shards from other tools) are read unchecked.
    check_crc=False reads without these checks.

    on_error: "fail" (default, as packer pack --on-error; "raise" is accepted too) stops at
    a damaged or truncated shard with a CorruptDataError naming the shard and byte
    offset; "skip" warns and moves on to
    the next shard (or, for a sample failing its check, the next sample), so that
    epoch is shorter (the warning says by how much). A shard found damaged while its
    samples are counted is left out of every epoch, with a warning.

    max_pixels: decoding refuses (CorruptDataError) an image whose header claims more
    pixels, before allocating them; the default is Pillow's own limit (readers.decode).

    state_dict() / load_state_dict(): the epoch and a position, for an exact mid-epoch
    resume. Taken in a DataLoader worker (torchdata's StatefulDataLoader does), the
    position is that worker's: {"rank", "worker", "workers", "samples" yielded}; to resume
    on other ranks, the workers of a rank, each loading its own, pool them as they start.
    readers.make_loader's loader saves the rank's: {"workers", "batches", "batch_size",
    "drop_last"}, from which each worker works out its own samples (a DataLoader takes
    batches from its workers in turn), so one state resumes every rank. Positions count
    samples: with on_error="skip", a damaged shard shifts them. Where Hugging Face
    Accelerate runs, state_dict() is refused (ValueError saying what to set): its caller
    there is the StatefulDataLoader of use_stateful_dataloader=True, which cannot resume a
    stream exactly (docs/frameworks.md).
    Remote shards (s3://, gs://, https:// URLs; a packer folder at a URL, shard URLs, a
    brace pattern of them; needs packer[remote]) are streamed: one sequential read per
    shard, the next prefetch_shards shards of a worker streaming while it reads one.
    storage_options: fsspec's (credentials, endpoint). Without a packer index, counting
    the samples reads every shard once.
    """

    def __init__(self, path_or_urls, split: str | None = None, transform=None, target_transform=None,
                 decode: str = "pil", shuffle: int = 0, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, on_error: str = "fail", check_crc: bool = True,
                 max_pixels: int = MAX_PIXELS, storage_options: dict | None = None, prefetch_shards: int = 2):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
        on_error = ON_ERROR_ALIASES.get(on_error, on_error)
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
        check_rank(rank, world_size, "WDSDataset")
        self.remote = remote_of(path_or_urls, storage_options)
        self.prefetch_shards = int(prefetch_shards)
        # A packer folder's index.json, whose identity (taken before it is read, checked after)
        # ties every worker's stream to the dataset these shards, counts and classes are of.
        self.index_file = index_file_of(path_or_urls, self.remote)
        self.identity = None if self.index_file is None else current_identity(self.index_file, self.remote)
        self.shards, self.counts, self.classes, self.split, self.pack = resolve(path_or_urls, split, self.remote)
        check_replaced(self)
        # A local packer folder is streamed through its index (readers._wds_read); this process's reader of it:
        self.packed = None if self.remote is not None else packed_folder(path_or_urls)
        self._index: wds.Reader | bool | None = None  # False: not a packer folder, or its index did not load
        self.transform, self.target_transform, self.decode = transform, target_transform, decode
        self.shuffle, self.seed, self.on_error, self.check_crc = int(shuffle), int(seed), on_error, bool(check_crc)
        self.rank, self.world_size = rank, world_size
        self.max_pixels = checked_max_pixels(max_pixels)
        # Shared with the DataLoader workers this process starts (fork or spawn), so a
        # set_epoch() in the main process reaches persistent workers too.
        self._epoch = multiprocessing.Value("q", 0, lock=False)
        self.resume = StreamResume()  # where passes start and stand: what state_dict() saves
        self.shard_counts()
        self._fingerprint: str | None = None  # fingerprint(), worked out once
        self._planned: tuple | None = None  # (epoch, rank, world size, history, plan): plan_pending_pass()'s
        self._accelerate = False  # a worker spawned by a process where Accelerate runs

    @property
    def epoch(self) -> int:
        if self.resume.pass_epoch is not None:
            return self.resume.pass_epoch
        return self._epoch if isinstance(self._epoch, int) else self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        self.resume.pass_epoch = None
        if isinstance(self._epoch, int):
            self._epoch = int(epoch)
        else:
            self._epoch.value = int(epoch)

    def world(self) -> tuple[int, int]:
        """(rank, world size): from the constructor, else readers.ranks.world()."""
        return world(self.rank, self.world_size)

    def shard_counts(self) -> list[int]:
        if self.counts is None:
            self.counts = [count_or_skip(self, path) for path in self.shards]
        return self.counts

    # The plan stage: the epoch's samples as tasks (runs of shards' samples), the rank's share,
    # each worker's run (readers.wds_elastic and readers._stream cut them).
    def plan(self, rank: int, world_size: int) -> list[Task]:
        """This rank's tasks for the current epoch: its equal, contiguous share of the epoch's
        samples in shard order (wds_elastic.share), so every epoch has the same length on every rank."""
        # Shares of samples, not of whole shards: dealing whole shards made each epoch's length the
        # largest rank's load, which changed with the shard order, and frameworks read a loader's
        # length once (Lightning cut longer epochs short at the first one's batch count).
        return share(self, self.epoch_tasks(), rank, world_size)

    def epoch_tasks(self) -> list[Task]:
        """The epoch's samples as whole-shard tasks, in its shard order."""
        counts = self.shard_counts()
        return [Task(shard) for shard in shard_order(self) if counts[shard]]

    def __len__(self) -> int:
        """Samples this rank yields per epoch: the total over the world size, rounded up
        (padded; the total sample count with one rank), the same every epoch."""
        return math.ceil(sum(self.shard_counts()) / self.world()[1])

    def batches(self, batch_size: int, drop_last: bool, workers: int) -> int:
        """Batches a DataLoader with `workers` workers makes of one epoch here: the same on
        every rank. Each worker batches its own run, so each ends in its own partial batch."""
        return sum(n // batch_size + (not drop_last and n % batch_size > 0)
                   for n in stream_sizes(len(self), max(1, workers)))

    def run_sizes(self, plan: list[Task], workers: int) -> list[int]:
        """Samples each of `workers` DataLoader workers reads of this rank's plan."""
        return stream_sizes(sum(map(self.task_size, plan)), workers)

    def worker_tasks(self, plan: list[Task], stream_id: int, workers: int) -> list[Task]:
        """Stream stream_id's run of the plan: its share of the rank's samples (stream_sizes),
        in plan order, cut at sample boundaries."""
        sizes = self.run_sizes(plan, workers)
        begin = sum(sizes[:stream_id])
        return cut(self, plan, begin, begin + sizes[stream_id])

    def task_size(self, task: Task) -> int:
        return (self.shard_counts()[task.shard] if task.stop is None else task.stop) - task.start

    def __iter__(self) -> Iterator:
        # Not a generator itself: a loaded position is taken when the pass begins (iter()).
        keep_heap_in_worker()
        self.resume.begin()
        rank, world_size = self.world()
        worker_id, workers = worker()
        history = self.resume.resumed_history(self.epoch, rank, world_size, workers)
        plan = pass_plan(self, rank, world_size, history)
        stream_id, skip = self.resume.resume_point(self.epoch, lambda: self.run_sizes(plan, workers), worker_id,
                                                   workers)
        self.resume.history = history
        tasks = self.worker_tasks(plan, stream_id, workers)
        if not tasks and plan:
            warnings.warn(f"WDSDataset: DataLoader worker {worker_id} of {workers} on rank {rank} has no sample "
                          f"to read (this rank has {len(self)} per epoch), so it idles; use fewer workers",
                          RuntimeWarning, stacklevel=2)
        progress = self.resume.progress = [self.epoch, skip, rank, stream_id, workers]
        rng = stream_rng(self.shuffle, self.seed, self.epoch, rank, stream_id)
        return decoded(self, samples_after(self, tasks, skip, rng), progress)

    def plan_pending_pass(self, workers: int) -> bool:
        """plan_pending_pass(): whether a loaded state's pass is pending, its plan made here."""
        return plan_pending_pass(self, workers)

    def shard_samples(self, shard: int, shards, start: int = 0, stop: int | None = None) -> Iterator:
        """readers._wds_read.shard_samples: (where, image bytes or None, label or the error)."""
        return shard_samples(self, shard, shards, start, stop)

    def index_reader(self) -> wds.Reader | None:
        """readers._wds_read.index_reader: this process's reader of the packer folder's index."""
        return index_reader(self)

    # The resume state (readers._wds_resume.StreamResume holds it).
    def settings(self) -> dict:
        """What fixes every worker's stream besides the epoch; a state loads only where these match."""
        if self._fingerprint is None:  # worked out once: StatefulDataLoader asks for a state every batch
            self._fingerprint = fingerprint(self.shards, self.shard_counts(), self.pack)
        return {"dataset": self._fingerprint, "split": self.split, "seed": self.seed, "shuffle": self.shuffle}

    def state_dict(self) -> dict:
        """{"kind", "version", settings, "epoch", "position"}: this process's place in the
        current pass (a worker's own stream), a loaded state's, or None at an epoch's start.

        Refused where Hugging Face Accelerate runs: the caller there is the StatefulDataLoader
        that use_stateful_dataloader=True makes, whose saved positions are not where training
        is (docs/frameworks.md)."""
        if self._accelerate or accelerate_runs():
            raise ValueError(ACCELERATE_STATEFUL)
        return self.stream_state()

    def stream_state(self) -> dict:
        """state_dict()'s state, for a loader that keeps its own count (readers.make_loader's)."""
        return self.resume.state(self.epoch, self.settings(), self.world()[1])

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass the saved epoch's, from where the state says; the passes after it
        run the epoch set_epoch() sets (one set before loading too). Raises
        ValueError if the state was saved over other shards, or with another seed, shuffle
        buffer. A state saved on another number of ranks or DataLoader workers resumes with
        the samples its streams had not yielded, dealt anew (readers.wds_elastic)."""
        self.resume.load(state, self.settings())

    def pass_history(self, epoch: int, workers: int) -> tuple[list[dict], int]:
        """(the passes of `epoch` before the one a loader over this dataset with `workers`
        workers has under way or pending, the batches of that pass handed out before it
        was saved): what its loader's state must carry besides its own batches."""
        return self.resume.pass_history(epoch, self.world()[1], workers)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:
            state["_epoch"] = self.epoch  # plain pickling (not a worker start): the value travels, not the memory
        else:  # a spawned worker does not import Accelerate, so cannot see that it runs (state_dict)
            state["_accelerate"] = self._accelerate or accelerate_runs()
        state["_index"] = None  # opened again where it is read
        state["_planned"] = None  # a forked worker's alone: a pickled dataset works its plan out where it runs
        if state["rank"] is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            # A spawned worker has no process group: it keeps the rank of the process that pickled it.
            state["rank"], state["world_size"] = self.world()
        return state

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shards={len(self.shards)}, split={self.split!r}, "
                f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, decode={self.decode!r})")


def plan_pending_pass(ds: WDSDataset, workers: int) -> bool:
    """Whether a loaded state's pass is pending; if so, its plan is worked out here, once, in
    the process about to start its `workers` DataLoader workers (or threads): forked ones
    inherit it instead of each replaying the saved streams' buffers again (spawned ones work
    it out, pickled without it). Nothing is planned for a worker's own state
    (StatefulDataLoader's), which the workers pool as they start: its refusal here is theirs."""
    if ds.resume.pending is None:
        return False
    rank, world_size = ds.world()
    try:
        history, _ = ds.resume.pass_history(ds.epoch, world_size, max(1, workers))
        ds._planned = (ds.epoch, rank, world_size, history, rank_plan(ds, rank, world_size, history)) \
            if history else None
    except ValueError:
        ds._planned = None
    return True


def pass_plan(ds: WDSDataset, rank: int, world_size: int, history: list[dict]) -> list[Task]:
    """This rank's tasks in a pass after `history` (wds_elastic.rank_plan): the one
    plan_pending_pass() worked out before this worker started, where it is this pass's."""
    planned = ds._planned
    if history and planned is not None and planned[:4] == (ds.epoch, rank, world_size, history):
        return planned[4]
    return rank_plan(ds, rank, world_size, history)


def decoded(ds: WDSDataset, samples: Iterator, progress: list[int]) -> Iterator:
    """The decode stage: (image, label) of each sample, transformed, counted in progress as it goes out."""
    for where, data, label in samples:
        progress[1] += 1
        try:
            image = decode(data, ds.decode, max_pixels=ds.max_pixels)
        except CorruptDataError as exc:  # named here, on failure only: an indexed sample's path is looked up
            raise CorruptDataError(f"{where}: {exc.reason or exc}", str(where), exc.reason) from exc
        if ds.transform is not None:
            image = ds.transform(image)
        if ds.target_transform is not None:
            label = ds.target_transform(label)
        yield image, label


class WDSMapDataset(PackedDataset):
    """Random access (ds[i]) to a `packer pack --to wds` folder in ImageFolder order, via its index.

    path may be a URL, read by ranges as LMDBDataset reads one (storage_options,
    cache_dir, cache_limit, block_size: docs/remote.md)."""

    format = "wds"
