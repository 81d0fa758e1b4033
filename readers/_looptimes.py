"""What diagnose() measures of a training loop: the loader's settings, what a sample costs
inside a worker stage by stage (timed in this process), each batch's wait and step, and the
threads each worker keeps busy (from /proc)."""
from __future__ import annotations

import os
import queue
import random
import threading
import time
from multiprocessing.reduction import ForkingPickler

import torch

from ._dataset import ReaderDataset
from .decode import decode
from .stats import batch_samples
from .transforms import RandomResizedCrop


BUSY_THREAD = 0.5  # a worker's thread running this share of its busiest thread's time counts as busy
BUSY_WORKER = 0.05  # a worker whose busiest thread ran less than this share of the time sat idle
PROBE_SECONDS = 0.5  # time spent timing samples in this process, at most
PROBE_SAMPLES = 64  # samples timed at least (time allowing): a rare slow one counts in the mean
STALL_SECONDS = 300.0  # diagnose's default bound on any one wait: a sample probed here, a batch


def loader_settings(loader) -> dict:
    """The DataLoader arguments of loader, or of the DataLoader it wraps."""
    inner = loader
    while not hasattr(inner, "num_workers") and hasattr(inner, "loader"):
        inner = inner.loader
    workers = int(getattr(inner, "num_workers", 0) or 0)
    return {
        "workers": workers,
        "persistent_workers": bool(getattr(inner, "persistent_workers", False)),
        "prefetch_factor": (getattr(inner, "prefetch_factor", None) or 2) if workers else None,
        "pin_memory": bool(getattr(inner, "pin_memory", False)),
        "batch_size": getattr(inner, "batch_size", None),
        "dataset": getattr(inner, "dataset", None),
        "collate_fn": getattr(inner, "collate_fn", None),
    }


def probe_samples(loader, settings: dict, stall: float = STALL_SECONDS) -> dict:
    """ms a sample of each stage a worker runs, timed here with one torch thread (as DataLoader
    workers run), for a map-style Dataset; {} for an iterable one. TimeoutError naming the
    sample (or collate) it was at when the probe takes over `stall` seconds."""
    dataset = settings["dataset"]
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return {}
    n = len(dataset)
    if n == 0:
        return {}
    count = min(n, max(settings["batch_size"] or 1, PROBE_SAMPLES))
    indexes = random.Random(0).sample(range(n), count)
    doing = ["the probe"]  # what the probe is at: named when it stalls
    stages = Waiter().call(lambda: one_thread(timed_stages, dataset, indexes, settings["collate_fn"], doing), stall,
                           lambda: f"{doing[-1]} (timed in this process, before the loop)")
    return stages


def one_thread(fn, *args):
    """fn(*args) with one torch thread, as a DataLoader worker runs (set in the calling
    thread: OpenMP keeps the setting per thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def timed_stages(dataset, indexes: list, collate_fn, doing: list) -> dict:
    totals: dict = {}
    samples = []
    deadline = time.perf_counter() + PROBE_SECONDS
    for i in indexes:
        doing.append(f"dataset[{i}]")
        times, sample = sample_stages(dataset, i)
        for name, seconds in times:
            totals[name] = totals.get(name, 0.0) + seconds
        samples.append(sample)
        if time.perf_counter() > deadline:
            break
    stages = {name: 1e3 * s / len(samples) for name, s in totals.items()}
    if collate_fn is not None:
        doing.append(f"collate_fn over {len(samples)} samples")
        t = time.perf_counter()
        batch = collate_fn(samples)
        stages["collate"] = 1e3 * (time.perf_counter() - t) / len(samples)
        stages["hand_over"] = 1e3 * hand_over_seconds(batch) / len(samples)
    return stages


def sample_stages(dataset, index: int) -> tuple[list, object]:
    """[(stage, seconds)] of one sample, and the sample: read, check (the record checksum,
    packed data), decode and transform for packer's Datasets, one getitem for any other."""
    if not isinstance(dataset, ReaderDataset) or dataset.target_transform is not None:
        t = time.perf_counter()
        sample = dataset[index]
        return [("getitem", time.perf_counter() - t)], sample
    t0 = time.perf_counter()
    data, label = dataset.reader.read_image(index)
    t1 = time.perf_counter()
    image = decode(data, dataset.decode, max_pixels=dataset.max_pixels)
    t2 = time.perf_counter()
    if dataset.transform is not None:
        image = dataset.transform(image)
    t3 = time.perf_counter()
    check = checksum_seconds(dataset.reader, data)
    times = [("read", max(0.0, t1 - t0 - check)), ("check", check), ("decode", t2 - t1), ("transform", t3 - t2)]
    if dataset.decode != "raw":  # readers' decode-aware crop, timed beside them for a fair comparison
        RAW_CROP(data)
        times.append((RAW_CROP_STAGE, time.perf_counter() - t3))
    return times, (image, label)


def checksum_seconds(reader, data: bytes) -> float:
    """The share of read_image spent checking the record's checksum (0 where reads are not
    checked): timed again here, as the reader computes it inside the read."""
    if not getattr(reader, "check_crc", False):
        return 0.0
    t = time.perf_counter()
    reader.record_digest(data)
    return time.perf_counter() - t


RAW_CROP = RandomResizedCrop(224)
RAW_CROP_STAGE = "raw_crop"  # not a stage the loader runs: the alternative to decode + transform


def worker_stages(stages: dict) -> dict:
    return {name: ms for name, ms in stages.items() if name != RAW_CROP_STAGE}


def hand_over_seconds(batch) -> float:
    """What a worker's queue does to a batch: tensors moved to shared memory and pickled,
    then unpickled by the main process."""
    t = time.perf_counter()
    try:
        ForkingPickler.loads(bytes(ForkingPickler.dumps(batch)))
    except Exception:  # a batch the queue could not carry either: the run itself says so
        return 0.0
    return time.perf_counter() - t


def run_loop(loader, step, steps: int, epochs: int, stall: float = STALL_SECONDS) -> list:
    """Per epoch: each batch's wait, each step's time, samples per batch, and the threads
    its workers kept busy. TimeoutError naming the batch when one takes over `stall` seconds."""
    measured, first = [], None
    waiter = Waiter()
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        waits, step_times, samples = [], [], []
        watch = ThreadWatch()
        asked = synced_clock()
        iterator = iter(loader)
        for k in range(steps):
            batch = waiter.call(lambda: next(iterator, _END), stall,
                                lambda: f"batch {k} of epoch {epoch} from the loader")
            if batch is _END:
                break
            got = time.perf_counter()
            waits.append(got - asked)
            if k == 1:  # the workers are up and working
                watch.start()
            if step is not None:
                step(batch)
            samples.append(batch_samples(batch))
            asked = synced_clock()
            step_times.append(asked - got)
        busy = watch.busy_threads()  # while this epoch's workers are still alive
        first = first if epoch else batch if waits else None
        del iterator  # workers that do not persist shut down here, outside the timed loop
        measured.append({"waits": waits, "steps": step_times, "samples": samples, "busy_threads": busy,
                         "first_batch": first})
    if not any(e["waits"] for e in measured):
        raise ValueError("diagnose: the loader gave no batches")
    return measured


_END = object()


class Waiter:
    """Runs calls in a thread of its own so that each wait is bounded: a __getitem__ or a
    loader that never returns becomes a TimeoutError naming it, not a hang. A stalled call's
    thread is left behind (Python cannot stop a thread); it is a daemon, so it does not hold
    the process at exit. One thread serves every call: a hand-over costs microseconds."""

    def __init__(self):
        self.asks: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def call(self, fn, seconds: float, what):
        """fn()'s result or exception; TimeoutError naming what() past `seconds`."""
        if self.thread is None:
            self.thread = threading.Thread(target=self.serve, name="diagnose-wait", daemon=True)
            self.thread.start()
        self.asks.put(fn)
        try:
            ok, value = self.answers.get(timeout=seconds)
        except queue.Empty:
            self.thread = None  # stuck in fn: a later call starts a fresh thread
            raise TimeoutError(f"diagnose: {what()} did not return within {seconds:g} s; it stalls there (a "
                               "worker or __getitem__ waiting on something that never comes): fix that, or "
                               "pass a larger timeout") from None
        if not ok:
            raise value
        return value

    def serve(self) -> None:
        asks, answers = self.asks, self.answers  # a stalled thread keeps its own queues
        while True:
            fn = asks.get()
            try:
                answers.put((True, fn()))
            except BaseException as exc:  # handed to the caller, raised there
                answers.put((False, exc))


def synced_clock() -> float:
    """Now, once CUDA work launched so far has finished (where the step uses CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class ThreadWatch:
    """Run time of every thread of this process's children (DataLoader workers), from /proc,
    to count the threads each worker keeps busy."""

    def __init__(self):
        self.started = None

    def start(self) -> None:
        self.started = (time.perf_counter(), child_thread_times())

    def busy_threads(self) -> dict:
        """{worker pid: threads that ran at least BUSY_THREAD of its busiest thread's time}, one
        left out for the result queue's feeder thread, which pickles batches and is busy too
        where samples are cheap (/proc names every thread of a worker alike); an intra-op
        pool shares the work about evenly. Workers that mostly sat idle are left out: their
        threads take no core from anyone. {} where /proc is missing."""
        if self.started is None:
            return {}
        started, before = self.started
        wall, ran = time.perf_counter() - started, {}
        for (pid, tid), seconds in child_thread_times().items():
            ran.setdefault(pid, []).append(seconds - before.get((pid, tid), 0.0))
        return {pid: max(1, sum(1 for t in times if t > 1e-3 and t >= BUSY_THREAD * max(times)) - 1)
                for pid, times in ran.items() if max(times) > BUSY_WORKER * wall}


def child_thread_times() -> dict:
    """{(pid, tid): seconds run} of each thread of each child of this process."""
    me, times = os.getpid(), {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return times
    for pid in pids:
        fields = stat_fields(f"/proc/{pid}/stat")
        if fields is None or int(fields[1]) != me:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            seconds = run_seconds(f"/proc/{pid}/task/{tid}")
            if seconds is not None:
                times[(int(pid), int(tid))] = seconds
    return times


def run_seconds(task: str) -> float | None:
    """A thread's time on a CPU: schedstat's nanoseconds, else stat's clock ticks."""
    try:
        with open(f"{task}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = stat_fields(f"{task}/stat")
        return None if fields is None else (int(fields[11]) + int(fields[12])) / TICK


TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(path: str) -> list | None:
    """The fields of a /proc stat file after the command name (which may hold spaces)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()
