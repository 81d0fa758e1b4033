"""WDSDataset: streams WebDataset tar shards (packer's or any tool's) across DDP ranks and workers.

One epoch is planned from the shard list alone: shards are ordered (a permutation seeded
by (seed, epoch) when shuffling), their samples cut into equal shares for the ranks, then
for the DataLoader workers, and only then streamed through a per-worker shuffle buffer.
Reading is three small generators: shard samples, the buffer, the conversion to (image,
label). A local packer folder's shard samples are read by its index (one pread per image,
no tar header parsed); any other shard, or a packer shard the index does not describe, is
parsed.

Resuming (docs/resume.md): each worker's stream is fixed by (seed, epoch, rank, worker,
workers), the buffer's draws included, so a position in it is a count of samples
yielded. To start a stream after its first k samples, the buffer's draws are replayed
over sample ordinals alone (no data), which tells which earlier samples the buffer still
holds and where reading resumes: only the shards holding those samples, or samples from
that point on, are read again; every other shard already consumed is skipped unread.
"""
from __future__ import annotations

import bisect
import math
import multiprocessing
import multiprocessing.context
import os
import random
import warnings
import zlib
from typing import Iterable, Iterator

import numpy as np
import torch.distributed
import torch.utils.data

from packer.errors import CorruptDataError, PackError, ReplacedError
from packer.formats import current_identity, replaced_error, wds

from ._dataset import PackedDataset
from ._pool import CountPool
from ._state_limits import MAX_EPOCH, MAX_WORKERS, MAX_WORLD_SIZE, bounded_int, shown
from ._stream import Task, consumed_samples, cut, replay_shuffle, stream_sizes
from ._wds_checks import sample_label
from ._wds_source import index_file_of, packed_folder, remote_of, resolve
from .decode import DECODE_MODES, MAX_PIXELS, checked_max_pixels, decode
from .heap import keep_heap_in_worker
from .ranks import accelerate_runs, check_rank, worker, world
from .sampler import STATE_VERSION, check_state, checked_count
from .wds_elastic import checked_history, continue_or_deal, rank_plan, shard_order, share

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
        self.check_replaced()
        # A local packer folder is streamed through its index (read_shards); this process's reader of it:
        self.packed = None if self.remote is not None else packed_folder(path_or_urls)
        self._index: wds.Reader | bool | None = None  # False: not a packer folder, or its index did not load
        self.transform, self.target_transform, self.decode = transform, target_transform, decode
        self.shuffle, self.seed, self.on_error, self.check_crc = int(shuffle), int(seed), on_error, bool(check_crc)
        self.rank, self.world_size = rank, world_size
        self.max_pixels = checked_max_pixels(max_pixels)
        # Shared with the DataLoader workers this process starts (fork or spawn), so a
        # set_epoch() in the main process reaches persistent workers too.
        self._epoch = multiprocessing.Value("q", 0, lock=False)
        # Where the workers that torchdata's StatefulDataLoader starts each with its own saved
        # state pool their counts, to resume on other ranks (readers._pool); shared as _epoch is.
        self._pool = CountPool()
        self.shard_counts()
        self._resume: tuple[int, dict | None, int] | None = None  # (epoch, position, its world size) to start at
        self._pass_epoch: int | None = None  # a loaded state's epoch, this process's own, for its pass alone
        self._loaded: tuple[int, dict | None, int] | None = None  # the last state loaded, as _resume
        self._history: list[dict] = []  # the passes of this epoch before this process's (readers.wds_elastic)
        self._progress: list[int] | None = None  # [epoch, samples yielded, rank, worker, workers] of this process
        self._fingerprint: str | None = None  # fingerprint(), worked out once
        self._accelerate = False  # a worker spawned by a process where Accelerate runs

    @property
    def epoch(self) -> int:
        if self._pass_epoch is not None:
            return self._pass_epoch
        return self._epoch if isinstance(self._epoch, int) else self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        self._pass_epoch = None
        if isinstance(self._epoch, int):
            self._epoch = int(epoch)
        else:
            self._epoch.value = int(epoch)

    def world(self) -> tuple[int, int]:
        """(rank, world size): from the constructor, else readers.ranks.world()."""
        return world(self.rank, self.world_size)

    def shard_counts(self) -> list[int]:
        if self.counts is None:
            self.counts = [self.count_or_skip(path) for path in self.shards]
        return self.counts

    def count_or_skip(self, path: str) -> int:
        try:
            if self.remote is not None:
                return wds.count_samples(path, self.opener([path]))
            return wds.count_samples(path)
        except CorruptDataError as exc:
            if self.on_error == "fail":
                raise
            warnings.warn(f"{exc}; skipped this shard, its samples are left out of every epoch", RuntimeWarning,
                          stacklevel=3)
            return 0

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
        end = begin + sizes[stream_id]
        return cut(self, plan, begin, end)

    def __iter__(self) -> Iterator:
        # Not a generator itself: a loaded position is taken when the pass begins (iter()).
        keep_heap_in_worker()
        if self._resume is None:  # a loaded state's pass has begun: the passes after it are the epoch set
            self._pass_epoch = None
        rank, world_size = self.world()
        worker_id, workers = worker()
        history = self.resumed_history(world_size, workers)
        plan = rank_plan(self, rank, world_size, history)
        stream_id, skip = self.resume_point(plan, worker_id, workers)
        self._history = history
        tasks = self.worker_tasks(plan, stream_id, workers)
        if not tasks and plan:
            warnings.warn(f"WDSDataset: DataLoader worker {worker_id} of {workers} on rank {rank} has no sample "
                          f"to read (this rank has {len(self)} per epoch), so it idles; use fewer workers",
                          RuntimeWarning, stacklevel=2)
        progress = self._progress = [self.epoch, skip, rank, stream_id, workers]
        return self.stream(tasks, skip, rank, stream_id, progress)

    def stream(self, tasks: list[Task], skip: int, rank: int, worker_id: int, progress: list[int]) -> Iterator:
        """This worker's (image, label) stream after its first `skip` samples, counted in progress."""
        rng = None
        if self.shuffle > 1:
            seed = np.random.SeedSequence([self.seed, progress[0], rank, worker_id]).generate_state(1)[0]
            rng = random.Random(int(seed))
        for where, image, label in self.samples_after(tasks, skip, rng):
            progress[1] += 1
            yield self.convert(where, image, label)

    def samples_after(self, tasks: list[Task], skip: int, rng: random.Random | None) -> Iterator:
        """The tasks' samples in the order this worker yields them (through the shuffle buffer
        when rng is given), less the first `skip`."""
        if not skip:
            samples = self.read_tasks(tasks)
            return samples if rng is None else shuffled(samples, self.shuffle, rng)
        sizes = [self.task_size(t) for t in tasks]
        if rng is None:
            return (sample for _, sample in self.read_ordinals(tasks, sizes, skip, ()))
        slots, consumed, drained = replay_shuffle(sum(sizes), self.shuffle, rng, skip)
        source = self.read_ordinals(tasks, sizes, consumed, slots)
        return resumed_shuffle(source, slots, drained, self.shuffle, rng)

    def task_size(self, task: Task) -> int:
        return (self.shard_counts()[task.shard] if task.stop is None else task.stop) - task.start

    def read_ordinals(self, tasks: list[Task], sizes: list[int], start: int, keep) -> Iterator[tuple[int, tuple]]:
        """(ordinal, sample) of the tasks' samples numbered from 0 whose ordinal is in `keep`
        or at least `start`; a task holding none of them is skipped unread."""
        wanted = sorted(set(keep))
        first = 0
        for task, size in zip(tasks, sizes):
            stop = first + size
            below = bisect.bisect_left(wanted, first)
            if stop > start or (below < len(wanted) and wanted[below] < stop):
                chosen = set(wanted[below:bisect.bisect_left(wanted, stop)])
                for ordinal, sample in enumerate(self.read_tasks([task]), first):
                    if ordinal >= start or ordinal in chosen:
                        yield ordinal, sample
            first = stop

    def settings(self) -> dict:
        """What fixes every worker's stream besides the epoch; a state loads only where these match."""
        return {"dataset": self.fingerprint(), "split": self.split, "seed": self.seed, "shuffle": self.shuffle}

    def fingerprint(self) -> str:
        """The shards, named without their folder (a dataset may move): their names and
        sample counts, and in a packer folder the pack's identity (readers._pack_identity).
        Worked out once: StatefulDataLoader asks for a state every batch."""
        if self._fingerprint is None:
            counts = self.shard_counts()
            names = "\n".join(f"{os.path.basename(path)} {count}" for path, count in zip(self.shards, counts))
            crc = zlib.crc32(names.encode("utf-8", "surrogateescape"))
            self._fingerprint = f"{len(self.shards)} shards, {sum(counts)} samples, crc32 {crc:08x}{self.pack}"
        return self._fingerprint

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
        if self._resume is not None:
            epoch, position = self._resume[:2]
        elif self._progress is not None and self._progress[0] == self.epoch:
            epoch, samples, rank, worker_id, workers = self._progress
            position = {"rank": rank, "worker": worker_id, "workers": workers, "samples": samples}
            if self._history:
                position["history"] = self._history
        else:
            epoch, position = self.epoch, None
        return {"kind": "WDSDataset", "version": STATE_VERSION, **self.settings(), "world_size": self.world()[1],
                "epoch": epoch, "position": None if position is None else dict(position)}

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass the saved epoch's, from where the state says; the passes after it
        run the epoch set_epoch() sets (one set before loading too). Raises
        ValueError if the state was saved over other shards, or with another seed, shuffle
        buffer. A state saved on another number of ranks or DataLoader workers resumes with
        the samples its streams had not yielded, dealt anew (readers.wds_elastic)."""
        check_state(state, "WDSDataset", self.settings())
        epoch = checked_count(state, "epoch", "WDSDataset", MAX_EPOCH)
        position = checked_position(state.get("position"))
        saved_world = bounded_int(state.get("world_size"), "world_size", "WDSDataset.load_state_dict", 1,
                                  MAX_WORLD_SIZE)
        # Not set_epoch(): a worker's epoch is shared with the main process, whose next passes run the
        # epoch set there (torchdata, finding a state saved after the loop finished, starts one at once).
        self._pass_epoch = epoch
        self._resume = self._loaded = (epoch, position, saved_world)

    def resumed_history(self, world_size: int, workers: int) -> list[dict]:
        """The passes before the one starting now: a loaded state's, and its own pass too
        when it was saved on other ranks or workers (then its position is used up)."""
        if self._resume is None or self._resume[0] != self.epoch:
            return []
        epoch, position, saved_world = self._resume
        history, position = continue_or_deal(position, saved_world, world_size, workers, self.pooled_streams)
        self._resume = (epoch, position, saved_world)
        return history

    def pooled_streams(self, position: dict) -> list[int]:
        """Every stream's count of samples in a rank whose DataLoader workers each loaded their
        own state (torchdata's StatefulDataLoader): pooled with the peers as they start."""
        worker_id, workers = worker()
        if position["worker"] != worker_id:
            raise ValueError(f"WDSDataset: the state is worker {position['worker']}'s, loaded in worker "
                             f"{worker_id}; load each worker's own state (torchdata's StatefulDataLoader does)")
        return self._pool.pool(self.world()[0], worker_id, workers, position["samples"])

    def pass_history(self, epoch: int, workers: int) -> tuple[list[dict], int]:
        """(the passes of `epoch` before the one a loader over this dataset with `workers`
        workers has under way or pending, the batches of that pass handed out before it
        was saved): what its loader's state must carry besides its own batches."""
        if self._loaded is None or self._loaded[0] != epoch:
            return [], 0
        _, position, saved_world = self._loaded
        history, kept = continue_or_deal(position, saved_world, self.world()[1], workers)
        return history, kept.get("batches", 0) if kept else 0

    def resume_point(self, plan: list[Task], worker_id: int, workers: int) -> tuple[int, int]:
        """(the stream this worker reads, samples of it already consumed): (worker_id, 0)
        without a loaded state for this epoch; the state is used once.

        A loader's position resumes with the workers' streams turned so that DataLoader
        worker 0, which a new pass asks first, reads the stream whose batch came next."""
        resume, self._resume = self._resume, None
        if resume is None or resume[0] != self.epoch or resume[1] is None:
            return worker_id, 0
        position = resume[1]
        if position["workers"] != workers:
            raise ValueError(f"WDSDataset: the state was saved with {position['workers']} DataLoader worker(s) and "
                             f"this loader has {workers}; each worker reads its own run of samples, so resume with "
                             f"{position['workers']} worker(s)")
        sizes = self.run_sizes(plan, workers)
        if "samples" in position:
            # Any rank's: every rank's worker w has yielded as many samples (equal shares, equal batch counts).
            if position["worker"] != worker_id:
                raise ValueError(f"WDSDataset: the state is worker {position['worker']}'s, loaded in worker "
                                 f"{worker_id}; load each worker's own state (torchdata's StatefulDataLoader does)")
            stream_id, skip = worker_id, position["samples"]
        else:
            consumed, following = consumed_samples(sizes, position["batches"], position["batch_size"],
                                                   position["drop_last"])
            stream_id = (worker_id + following) % workers
            skip = consumed[stream_id]
        if skip > sizes[stream_id]:
            raise ValueError(f"WDSDataset: the state has {skip} samples read from stream {stream_id}, which has "
                             f"{sizes[stream_id]} this epoch; it was saved over other data")
        return stream_id, skip
    def opener(self, paths: list[str]):
        """How wds.iter_samples opens these shards, read in this order: None (local files) or streams
        started ahead (remote)."""
        if self.remote is None:
            return None
        from packer.remote.stream import ShardsAhead

        return ShardsAhead(self.remote, paths, self.prefetch_shards)

    def read_tasks(self, tasks: Iterable[Task]) -> Iterator[tuple[str, bytes, int]]:
        """(where, image bytes, label) of every image sample of the tasks' shards, in order, checked."""
        tasks = list(tasks)
        opener = self.opener([self.shards[task.shard] for task in tasks])
        try:
            yield from self.read_shards(tasks, opener)
        finally:
            if opener is not None:
                opener.close()

    def read_shards(self, tasks: list[Task], opener) -> Iterator[tuple[str, bytes, int]]:
        for task in tasks:
            path, expected = self.shards[task.shard], self.shard_counts()[task.shard]
            wanted = expected if task.stop is None else task.stop
            got = task.start  # the shard's samples passed, counted from its first
            try:
                for where, image, label in self.shard_samples(task.shard, opener, task.start):
                    got += 1
                    if image is not None:
                        yield where, image, label
                    elif self.on_error == "fail":
                        raise label
                    else:
                        warnings.warn(f"{label}; skipped this sample, 1 sample short this epoch", RuntimeWarning,
                                      stacklevel=2)
                    if got == wanted:
                        break
                if got < wanted:
                    raise CorruptDataError(f"{path}: ended after {got} samples, {expected} expected; the shard "
                                           "is truncated or was replaced (re-create it, or read with "
                                           "on_error='skip')", path)
            except ReplacedError:
                raise  # not damage to skip: every shard from here on is the other dataset's
            except CorruptDataError as exc:
                if self.on_error == "fail":
                    raise
                warnings.warn(f"{exc}; skipped the rest of this shard, {wanted - got} sample(s) short this epoch",
                              RuntimeWarning, stacklevel=2)

    def check_replaced(self) -> None:
        """Raise the project's error if the packer folder was replaced (pack --force) since
        this Dataset read its index: its shards would be read under a stale class list."""
        if self.index_file is not None and current_identity(self.index_file, self.remote) != self.identity:
            raise replaced_error(self.index_file)

    def shard_samples(self, shard: int, opener, start: int = 0
                      ) -> Iterator[tuple[str, bytes | None, int | CorruptDataError]]:
        """(where, image bytes, label) of each image sample of the shard from its start-th,
        in order; a sample failing its checks comes as (where, None, the error). Damage that
        ends the shard raises.

        A local packer folder is read through its index: each image is one pread at the
        offset records.bin gives, in the order the shard holds them, checked against the
        table's checksum, its label from the table (both checked as the table loads), so no
        tar header or .cls/.json member is parsed: the same samples, at the cost of a read
        by index. Any other shard is parsed (packer.formats.wds.iter_samples), its .json checked, and so
        is a packer shard whose index does not load or whose size is not the one the index
        gives (cut short, replaced): parsing says where the damage is."""
        reader = self.index_reader()
        if reader is not None and reader.as_indexed(shard):
            labels, paths = reader.labels, reader.paths
            for index, image in reader.read_stored(shard, start):
                where = f"{reader.path}: {paths[index]}"  # as the map-style Datasets name a record
                if isinstance(image, CorruptDataError):
                    yield where, None, image
                else:
                    yield where, image, labels.item(index)
            return
        path = self.shards[shard]
        passed = 0
        opened = False
        for sample in wds.iter_samples(path, opener=opener):
            if not opened:  # checked once the shard is open: then the shard read is the dataset's checked
                self.check_replaced()
                opened = True
            suffix = wds.image_suffix(sample.parts)
            if suffix is None:
                continue
            if passed < start:  # another worker's (or an earlier task's) samples: parsed past, not checked
                passed += 1
                continue
            where = f"{path}: {sample.key}"
            try:
                yield where, sample.parts[suffix], sample_label(where, sample.parts, suffix, self.check_crc,
                                                                len(self.classes))
            except CorruptDataError as exc:
                yield where, None, exc
        if not opened:
            self.check_replaced()
        if passed < start:
            raise CorruptDataError(f"{path}: ended after {passed} samples, {self.shard_counts()[shard]} expected; "
                                   "the shard is truncated or was replaced (re-create it, or read with "
                                   "on_error='skip')", path)

    def index_reader(self) -> wds.Reader | None:
        """This process's reader of the packer folder's index, opened for streaming; None
        for other shards, and where the index does not load or lists other shards."""
        if self._index is None:
            self._index = False
            if self.packed is not None:
                try:
                    reader = wds.Reader(self.packed, self.split, check_crc=self.check_crc)
                except PackError:
                    return None
                if reader.identity != self.identity:  # its tables and labels are another dataset's
                    raise replaced_error(self.index_file)
                try:
                    reader.records, reader.paths, reader.labels  # loaded and checked now: damage means parsing
                except PackError:
                    return None
                if [os.path.join(self.packed, name) for name in reader.shards] == self.shards:
                    reader.advise("sequential")
                    self._index = reader
        return self._index or None

    def convert(self, where: str, data: bytes, label: int):
        image = decode(data, self.decode, where, self.max_pixels)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:
            # Plain pickling (not a worker start): shared memory cannot travel, the value can;
            # the receiver makes its own pool (__setstate__).
            state["_epoch"], state["_pool"] = self.epoch, None
        else:  # a spawned worker does not import Accelerate, so cannot see that it runs (state_dict)
            state["_accelerate"] = self._accelerate or accelerate_runs()
        state["_progress"] = None  # this process's pass, not the receiver's
        state["_index"] = None  # opened again where it is read
        if state["rank"] is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            # A spawned worker has no process group: it keeps the rank of the process that pickled it.
            state["rank"], state["world_size"] = self.world()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._pool is None:
            self._pool = CountPool()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shards={len(self.shards)}, split={self.split!r}, "
                f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, decode={self.decode!r})")


def shuffled(items: Iterable, size: int, rng: random.Random, buffer: list | None = None) -> Iterator:
    """A shuffle buffer: keep `size` items, yield a random one as each new one arrives.
    buffer: the items already held (a resumed stream's)."""
    buffer = [] if buffer is None else buffer
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer


def resumed_shuffle(source: Iterator[tuple[int, tuple]], slots: list[int], drained: bool, size: int,
                    rng: random.Random) -> Iterator:
    """shuffled()'s output from a replayed state on: source yields (ordinal, sample) in
    order, first every ordinal in slots (all read before the stop), then the unread rest."""
    found: dict[int, tuple] = {}
    while len(found) < len(slots):
        ordinal, sample = next(source)
        found[ordinal] = sample
    buffer = [found[ordinal] for ordinal in slots]
    if drained:
        return iter(buffer)
    return shuffled((sample for _, sample in source), size, rng, buffer)


POSITION_KEYS = ({"rank", "worker", "workers", "samples"}, {"workers", "batches", "batch_size", "drop_last"})
POSITION_MOST = {"rank": MAX_WORLD_SIZE - 1, "worker": MAX_WORKERS - 1, "workers": MAX_WORKERS}


def checked_position(position) -> dict | None:
    """A state's position: None, one worker's or a loader's (see WDSDataset), checked,
    its counts within what a state may name (readers._state_limits)."""
    if position is None:
        return None
    if isinstance(position, dict) and "history" in position:
        return {**checked_position({k: v for k, v in position.items() if k != "history"}),
                "history": checked_history(position["history"])}
    if not isinstance(position, dict) or set(position) not in POSITION_KEYS:
        raise ValueError(f"WDSDataset.load_state_dict: position must be None or a dict with the keys "
                         f"{' or '.join(str(sorted(k)) for k in POSITION_KEYS)}, got {shown(position)}")
    who = "WDSDataset.load_state_dict: position's"
    for key, value in position.items():
        if key == "drop_last":
            if not isinstance(value, bool):
                raise ValueError(f"WDSDataset.load_state_dict: drop_last must be a bool, got {shown(value)}")
        else:
            bounded_int(value, key, who, 1 if key in ("workers", "batch_size") else 0, POSITION_MOST.get(key))
    if "worker" in position and position["worker"] >= position["workers"]:
        raise ValueError(f"WDSDataset.load_state_dict: position's worker must be below its workers, got "
                         f"{shown(position)}")
    return dict(position)


class WDSMapDataset(PackedDataset):
    """Random access (ds[i]) to a `packer pack --to wds` folder in ImageFolder order, via its index.

    path may be a URL, read by ranges as LMDBDataset reads one (storage_options,
    cache_dir, cache_limit, block_size: docs/remote.md)."""

    format = "wds"
