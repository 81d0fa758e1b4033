"""Thread workers for make_loader (worker_kind="threads-inline" or "threads").

ThreadLoader is an EpochLoader whose batches are made by a pool of threads instead of
DataLoader worker processes. The trainer keeps the sampler, the batch sampler and the
loader's position, exactly as with process workers, so state_dict()/load_state_dict()
are the EpochLoader's own: a state saved with processes resumes with threads and back.
What moves is where a batch of indexes becomes a collated batch:

- "threads-inline": a thread pool in the trainer process. No process to start or
  import torch in, one copy of the dataset's handles; the threads share the trainer's
  GIL, so a GIL-holding step (a Python transform) slows the training loop beside it.
- "threads": one background process per rank runs the thread pool and hands batches
  back through torch's shared memory (torch.multiprocessing): the trainer maps each
  batch's storage, no copy. The process only reads, decodes and collates; the
  trainer's GIL is left to training.

Batches come out in the sampler's order, at most `prefetch` batches ahead of the
consumer. Every wait is bounded: a background process that dies is reported within
POLL seconds; one whose trainer dies (SIGKILL included) exits within POLL seconds, and
torch's file-descriptor sharing leaves no name in /dev/shm to clean up. A sample that
raises surfaces in the trainer as a RuntimeError naming its index.
"""
from __future__ import annotations

import collections
import functools
import os
import queue
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.multiprocessing as tmp
import torch.utils.data as tud
from torch.utils.data._utils.pin_memory import pin_memory as pin_batch

from .buffers import share_batches

WORKER_KINDS = ("processes", "threads", "threads-inline")
# Seconds between checks that the other side is alive: the bound on noticing a death.
POLL = 1.0
# Seconds a background process may take to start and hand back its first batch
# (importing torch under load) before the trainer gives up on it.
START_LIMIT = 120.0


class SampleError(RuntimeError):
    """A sample that raised while a thread worker read, decoded or collated it."""


def fetch(dataset, indexes: list, collate_fn):
    """One batch: the samples at `indexes`, collated."""
    return collated(read_samples(dataset, indexes), indexes, collate_fn)


def read_samples(dataset, indexes: list) -> list:
    """The samples at `indexes`. An error names the sample's index (a batch read through
    __getitems__ is read again one by one to find it)."""
    try:
        getitems = getattr(dataset, "__getitems__", None)
        return getitems(indexes) if getitems else [read_one(dataset, i) for i in indexes]
    except SampleError:
        raise
    except Exception as error:
        for index in indexes:
            read_one(dataset, index)  # raises SampleError at the culprit
        raise SampleError(f"thread worker: reading the batch of samples {indexes} failed: "
                          f"{type(error).__name__}: {error}") from error


def collated(samples: list, indexes: list, collate_fn):
    try:
        return collate_fn(samples)
    except Exception as error:
        raise SampleError(f"thread worker: collating the batch of samples {indexes} failed: "
                          f"{type(error).__name__}: {error}") from error


def submit_batch(pool: ThreadPoolExecutor, dataset, indexes: list, collate_fn, parts: int = 1) -> Future:
    """A future of one collated batch. parts > 1 splits its reading among that many threads
    (a pass's first batch: it then arrives `parts` times sooner), collated by the thread
    that reads the last part; otherwise one thread makes the whole batch."""
    if parts <= 1 or len(indexes) < 2:
        return pool.submit(fetch, dataset, indexes, collate_fn)
    size = -(-len(indexes) // parts)
    reads = [pool.submit(read_samples, dataset, indexes[i:i + size]) for i in range(0, len(indexes), size)]
    batch, left, lock = Future(), [len(reads)], threading.Lock()

    def part_done(_) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            batch.set_result(collated([s for read in reads for s in read.result()], indexes, collate_fn))
        except BaseException as error:  # a part's SampleError, or its cancellation at shutdown
            batch.set_exception(error)

    for read in reads:
        read.add_done_callback(part_done)
    return batch


def read_one(dataset, index):
    try:
        return dataset[index]
    except Exception as error:
        raise SampleError(f"thread worker: sample {index} of {type(dataset).__name__} failed: "
                          f"{type(error).__name__}: {error}") from error


def in_order(pool: ThreadPoolExecutor, threads: int, batches, dataset, collate_fn, prefetch: int):
    """The collated batches of `batches` (lists of indexes), in order, with at most
    `prefetch` of them submitted ahead of the one handed out; the first read by every thread."""
    pending = collections.deque()
    batches = iter(batches)
    for indexes in batches:
        parts = 1 if pending else threads
        pending.append(submit_batch(pool, dataset, list(indexes), collate_fn, parts))
        if len(pending) >= prefetch:
            break
    while pending:
        batch = pending.popleft().result()
        for indexes in batches:
            pending.append(submit_batch(pool, dataset, list(indexes), collate_fn))
            break
        yield batch


class ThreadBatches(tud.DataLoader):
    """The batch source under EpochLoader's pass: DataLoader.__iter__ replaced by thread
    workers (ThreadLoader puts it after EpochLoader in its bases, so EpochLoader's
    super().__iter__() lands here)."""

    threads: int = 1
    kind: str = "threads-inline"
    prefetch: int = 2
    pin: bool = False
    context = None  # the background process's multiprocessing context (None: fork, or spawn after CUDA)

    def __iter__(self):
        batches = self._index_sampler  # the batch sampler, resumed by load_state_dict
        if self.kind == "threads-inline":
            return inline_batches(self.dataset, batches, self.collate_fn, self.threads, self.prefetch)
        return background_batches(self.dataset, batches, self.collate_fn, self.threads, self.prefetch,
                                  self.pin, self.context)


def one_intra_op_thread() -> None:
    """Each worker thread's torch ops run on that thread alone (OpenMP's setting is per
    thread, so the trainer's own ops keep theirs): W threads each fanning out to every
    core would oversubscribe them, as one thread per worker process avoids."""
    torch.set_num_threads(1)


def inline_batches(dataset, batches, collate_fn, threads: int, prefetch: int):
    pool = ThreadPoolExecutor(threads, thread_name_prefix="packer-loader", initializer=one_intra_op_thread)
    try:
        yield from in_order(pool, threads, batches, dataset, collate_fn, prefetch)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def background_batches(dataset, batches, collate_fn, threads: int, prefetch: int, pin: bool, context):
    """Batches made in one background process: the trainer sends each batch's indexes
    (numbered), the process's threads collate them, the trainer hands them out in order."""
    if context is None:  # fork starts soonest, but is unsafe once CUDA is initialised here
        context = "spawn" if torch.cuda.is_initialized() else "fork"
    ctx = tmp.get_context(context) if isinstance(context, str) else context
    requests, results = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=serve, args=(dataset, collate_fn, threads, requests, results, os.getpid()),
                          daemon=True, name="packer-thread-loader")
    process.start()
    try:
        batches = iter(batches)
        sent = taken = 0
        done: dict[int, object] = {}
        for indexes in batches:
            requests.put((sent, list(indexes)))
            sent += 1
            if sent >= prefetch:
                break
        while taken < sent:
            while taken not in done:
                number, ok, payload = receive(results, process, first=taken == 0)
                done[number] = (ok, payload)
            ok, payload = done.pop(taken)
            taken += 1
            if not ok:
                raise SampleError(payload)
            for indexes in batches:
                requests.put((sent, list(indexes)))
                sent += 1
                break
            yield pin_batch(payload) if pin else payload
    finally:
        stop(process, requests, results)


def receive(results, process, first: bool):
    """The next (number, ok, batch or message) from the process, waiting at most POLL
    seconds at a time and reporting a process that has died."""
    waited = 0.0
    while True:
        try:
            return results.get(timeout=POLL)
        except queue.Empty:
            waited += POLL
            if not process.is_alive():
                raise died(process) from None
        except Exception as error:  # a batch whose shared memory its dead sender can no longer pass
            process.join(timeout=POLL)
            if not process.is_alive():
                raise died(process) from error
            raise
        if first and waited >= START_LIMIT:
            raise RuntimeError(f"make_loader: the thread-worker process (pid {process.pid}) handed back no "
                               f"batch in {START_LIMIT:.0f} s")


def died(process) -> RuntimeError:
    return RuntimeError(f"make_loader: the thread-worker process (pid {process.pid}) exited with code "
                        f"{process.exitcode} while the trainer waited for a batch; if it was killed (a negative "
                        f"code is the signal), look for an out-of-memory kill in dmesg")


def stop(process, requests, results) -> None:
    """Ask the process to end, then make sure it has (bounded), and drop the queues."""
    try:
        requests.put(None)
    except (OSError, ValueError):
        pass
    process.join(timeout=5 * POLL)
    if process.is_alive():
        process.kill()
        process.join(timeout=5 * POLL)
    for q in (requests, results):
        q.cancel_join_thread()
        q.close()


def serve(dataset, collate_fn, threads: int, requests, results, trainer: int) -> None:
    """The background process: collate each requested batch on the thread pool and send
    it back (tensors through shared memory). Ctrl-C is the trainer's to handle (it stops
    this process); a trainer that vanishes ends it within POLL seconds."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # the pool is the parallelism
    share_batches()  # collate straight into shared memory: the queue then moves no bytes

    def send(number: int, batch: Future) -> None:
        try:
            message = (number, True, batch.result())
        except BaseException as error:
            message = (number, False, str(error))
        results.put(message)  # thread-safe: the queue's feeder thread sends it

    with ThreadPoolExecutor(threads, thread_name_prefix="packer-loader", initializer=one_intra_op_thread) as pool:
        while True:
            try:
                request = requests.get(timeout=POLL)
            except queue.Empty:
                if os.getppid() != trainer:
                    os._exit(0)  # orphaned: the trainer is gone
                continue
            if request is None:
                break
            number, indexes = request
            batch = submit_batch(pool, dataset, indexes, collate_fn, threads if number == 0 else 1)
            batch.add_done_callback(functools.partial(send, number))
    # The trainer has taken every batch it asked for before it says stop; one that broke
    # off early wants none of the rest, so do not wait to flush them.
    results.cancel_join_thread()
