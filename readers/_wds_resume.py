"""A WDSDataset's resume state: the position a loaded state starts the next pass at, the
passes of the epoch before it, and this process's own pass as it goes, saved and loaded as
{"kind": "WDSDataset", "version", settings, "world_size", "epoch", "position"} (docs/resume.md).

A position is one DataLoader worker's ({"rank", "worker", "workers", "samples" yielded}) or a
loader's ({"workers", "batches", "batch_size", "drop_last"}), either with the "history" of
passes on other ranks or workers (readers.wds_elastic). Workers that torchdata's
StatefulDataLoader hands each its own position pool their counts (readers._pool)."""
from __future__ import annotations

import multiprocessing.context
import os
import zlib

from ._pool import CountPool
from ._state_limits import MAX_EPOCH, MAX_WORKERS, MAX_WORLD_SIZE, bounded_int, shown
from ._stream import consumed_samples
from .ranks import worker
from .sampler import STATE_VERSION, check_state, checked_count
from .wds_elastic import checked_history, continue_or_deal

POSITION_KEYS = ({"rank", "worker", "workers", "samples"}, {"workers", "batches", "batch_size", "drop_last"})
POSITION_MOST = {"rank": MAX_WORLD_SIZE - 1, "worker": MAX_WORKERS - 1, "workers": MAX_WORKERS}


class StreamResume:
    """Where a WDSDataset's passes start and stand: pending, a loaded (epoch, position, its
    world size) the next pass starts at (used once); pass_epoch, that state's epoch, this
    process's own, for its pass alone; loaded, the last state loaded; history, the passes of
    this epoch before this process's; progress, [epoch, samples yielded, rank, worker,
    workers] of this process's pass; pool, where a rank's workers pool their counts, shared
    with the DataLoader workers this process starts."""

    def __init__(self):
        self.pool = CountPool()
        self.pending: tuple[int, dict | None, int] | None = None
        self.pass_epoch: int | None = None
        self.loaded: tuple[int, dict | None, int] | None = None
        self.history: list[dict] = []
        self.progress: list[int] | None = None

    def load(self, state: dict, settings: dict) -> None:
        """Make the next pass the saved epoch's, from where the state says (checked first)."""
        check_state(state, "WDSDataset", settings)
        epoch = checked_count(state, "epoch", "WDSDataset", MAX_EPOCH)
        position = checked_position(state.get("position"))
        saved_world = bounded_int(state.get("world_size"), "world_size", "WDSDataset.load_state_dict", 1,
                                  MAX_WORLD_SIZE)
        # Not set_epoch(): a worker's epoch is shared with the main process, whose next passes run the
        # epoch set there (torchdata, finding a state saved after the loop finished, starts one at once).
        self.pass_epoch = epoch
        self.pending = self.loaded = (epoch, position, saved_world)

    def state(self, epoch: int, settings: dict, world_size: int) -> dict:
        """The state of this process's place in the current pass (`epoch`'s), a loaded
        state's, or None at an epoch's start."""
        if self.pending is not None:
            epoch, position = self.pending[:2]
        elif self.progress is not None and self.progress[0] == epoch:
            epoch, samples, rank, worker_id, workers = self.progress
            position = {"rank": rank, "worker": worker_id, "workers": workers, "samples": samples}
            if self.history:
                position["history"] = self.history
        else:
            position = None
        return {"kind": "WDSDataset", "version": STATE_VERSION, **settings, "world_size": world_size,
                "epoch": epoch, "position": None if position is None else dict(position)}

    def begin(self) -> None:
        """A pass begins: once a loaded state's pass has begun, the passes after it run the epoch set."""
        if self.pending is None:
            self.pass_epoch = None

    def resumed_history(self, epoch: int, rank: int, world_size: int, workers: int) -> list[dict]:
        """The passes before the one starting now: a loaded state's, and its own pass too
        when it was saved on other ranks or workers (then its position is used up)."""
        if self.pending is None or self.pending[0] != epoch:
            return []
        saved_epoch, position, saved_world = self.pending
        history, position = continue_or_deal(position, saved_world, world_size, workers,
                                             lambda position: self.pooled_streams(rank, position))
        self.pending = (saved_epoch, position, saved_world)
        return history

    def pooled_streams(self, rank: int, position: dict) -> list[int]:
        """Every stream's count of samples in a rank whose DataLoader workers each loaded their
        own state (torchdata's StatefulDataLoader): pooled with the peers as they start."""
        worker_id, workers = worker()
        check_own(position, worker_id)
        return self.pool.pool(rank, worker_id, workers, position["samples"])

    def resume_point(self, epoch: int, run_sizes, worker_id: int, workers: int) -> tuple[int, int]:
        """(the stream this worker reads, samples of it already consumed): (worker_id, 0)
        without a loaded state for this epoch; the state is used once. run_sizes(): each
        stream's samples this pass.

        A loader's position resumes with the workers' streams turned so that DataLoader
        worker 0, which a new pass asks first, reads the stream whose batch came next."""
        resume, self.pending = self.pending, None
        if resume is None or resume[0] != epoch or resume[1] is None:
            return worker_id, 0
        position = resume[1]
        if position["workers"] != workers:
            raise ValueError(f"WDSDataset: the state was saved with {position['workers']} DataLoader worker(s) and "
                             f"this loader has {workers}; each worker reads its own run of samples, so resume with "
                             f"{position['workers']} worker(s)")
        sizes = run_sizes()
        if "samples" in position:
            # Any rank's: every rank's worker w has yielded as many samples (equal shares, equal batch counts).
            check_own(position, worker_id)
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

    def pass_history(self, epoch: int, world_size: int, workers: int) -> tuple[list[dict], int]:
        """(the passes of `epoch` before the one a loader with `workers` workers has under
        way or pending, the batches of that pass handed out before it was saved)."""
        if self.loaded is None or self.loaded[0] != epoch:
            return [], 0
        _, position, saved_world = self.loaded
        history, kept = continue_or_deal(position, saved_world, world_size, workers)
        return history, kept.get("batches", 0) if kept else 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:
            state["pool"] = None  # plain pickling: shared memory cannot travel; the receiver makes its own
        state["progress"] = None  # this process's pass, not the receiver's
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.pool is None:
            self.pool = CountPool()


def check_own(position: dict, worker_id: int) -> None:
    if position["worker"] != worker_id:
        raise ValueError(f"WDSDataset: the state is worker {position['worker']}'s, loaded in worker "
                         f"{worker_id}; load each worker's own state (torchdata's StatefulDataLoader does)")


def fingerprint(shards: list[str], counts: list[int], pack: str) -> str:
    """The shards, named without their folder (a dataset may move): their names and sample
    counts, and in a packer folder the pack's identity (readers._pack_identity)."""
    names = "\n".join(f"{os.path.basename(path)} {count}" for path, count in zip(shards, counts))
    crc = zlib.crc32(names.encode("utf-8", "surrogateescape"))
    return f"{len(shards)} shards, {sum(counts)} samples, crc32 {crc:08x}{pack}"


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
