"""The parallel engine packing, converting and verifying share: load(job) for every job,
in order, by threads or processes working a bounded distance ahead of one consumer.

Threads for I/O-bound loads (reading files, CRC-32: both release the GIL), processes for
CPU-bound ones (decoding). Either way memory stays flat however many jobs there are, and
stopping early (an error, a Ctrl-C, a closed generator) never hangs: worker processes
ignore SIGINT (only the parent decides), and no feeder thread can block the teardown.
"""
from __future__ import annotations

import contextlib
import itertools
import queue
import signal
import threading
import time
import warnings
from collections import deque
from multiprocessing import Pool
from typing import Any, Callable, Iterator

from .errors import escaping
from .interrupts import STOP_SIGNALS, ignore_stop_signals

CHUNK = 16  # files per task sent to a worker: amortises IPC without hurting order latency
# Records of a packed dataset per task (convert, merge): reading a record is cheap, so amortise the IPC more.
RECORD_CHUNK = 64
# Reader threads run at most this many files, and about this many bytes, ahead of the writer:
# enough to keep the disk busy through a commit, bounded so memory stays flat.
WINDOW_FILES = 4096
WINDOW_BYTES = 256 << 20
STOP_GRACE_S = 3.0  # how long a stopping pool waits for the chunks in flight before killing its workers
READER_WAIT_S = 0.002  # how long a reader as far ahead as it may go waits before it looks again
# How long the consumer waits for a result at a time: a stop signal another thread took waits this long.
STOP_LOOK_S = 0.1


def load_in_processes(jobs: list, load: Callable[[Any], Any], workers: int,
                  chunk: int = CHUNK) -> Iterator:
    """load(job) for every job, in order, run by `workers` processes with bounded look-ahead.

    load must be picklable; each worker receives it once, so it may keep state (open
    readers) for the life of the pool. At most 4 chunks per worker are in flight, and
    nothing but this generator submits work, so tearing the pool down (on an error, a
    Ctrl-C or an early close) never waits on a blocked feeder. The pool's own thread hands
    each chunk over through a queue (in_order), never through a lock this thread takes.
    """
    if workers <= 1:
        yield from map(load, jobs)
        return
    parts = (jobs[i:i + chunk] for i in range(0, len(jobs), chunk))
    pool = None
    pending: deque = deque()  # the chunks submitted and not yet taken, oldest first
    finished: queue.SimpleQueue = queue.SimpleQueue()
    arrived: dict = {}
    try:
        with stop_signals_blocked():  # so no worker can take a Ctrl-C or SIGTERM before it starts ignoring them
            pool = Pool(workers, initializer=_start_worker, initargs=(load,))
        submitted = 0
        for part in itertools.islice(parts, workers * 4):
            submit(pool, part, submitted, pending, finished)
            submitted += 1
        taken = 0
        while pending:
            done = in_order(finished, arrived, taken)
            taken += 1
            pending.popleft()
            part = next(parts, None)
            if part is not None:
                submit(pool, part, submitted, pending, finished)
                submitted += 1
            yield from done
    finally:
        if pool is not None:
            stop_pool(pool, pending)


def in_order(finished: queue.SimpleQueue, arrived: dict, number: int):
    """Result `number`, from a queue other threads put (number, result) on as each finishes,
    in any order; those that come before it wait in arrived. An exception is raised.

    Why a queue: Ctrl-C or SIGTERM raises in this (the main) thread at any bytecode, and one
    raised just after a `with condition:` takes its lock leaves the lock held, so the
    threads that hand results over would wait on it forever, and so would the teardown.
    SimpleQueue's get and put are single calls into C: nothing is left held. The wait is
    sliced so that a signal another thread took is still raised here within moments."""
    while number not in arrived:
        try:
            done, result = finished.get(timeout=STOP_LOOK_S)
        except queue.Empty:
            continue
        arrived[done] = result
    result = arrived.pop(number)
    if isinstance(result, BaseException):
        raise result
    return result


def submit(pool, part: list, number: int, pending: deque, finished: queue.SimpleQueue) -> None:
    """Queue part on pool as chunk `number`, with no Ctrl-C or SIGTERM between: the pool's
    thread puts (number, its results or its exception) on finished.

    apply_async registers the job with the pool before it queues it: interrupted between
    the two, the job would never run, and Pool.join() waits for every registered job."""
    def hand_over(result) -> None:
        finished.put((number, result))
    with stop_signals_deferred():
        pending.append(pool.apply_async(_load_part, (part,), callback=hand_over, error_callback=hand_over))


def stop_pool(pool, pending: deque, grace: float = STOP_GRACE_S) -> None:
    """Let the chunks in flight finish, then let the workers exit.

    A worker killed while it sends a result, or while it waits for a task, leaves a queue's
    lock held: the pool's threads then wait on it forever, and so does terminate(). Only
    workers still busy after `grace` seconds (a hung read) are killed, with SIGKILL since
    they ignore SIGTERM (_start_worker); terminate() then only reaps them.
    """
    pool.close()
    deadline = time.monotonic() + grace
    while not all(result.ready() for result in pending) and time.monotonic() < deadline:
        time.sleep(0.01)  # ready() reads a flag; wait() would take the result's lock (see in_order)
    if not all(result.ready() for result in pending):
        for worker in pool._pool:  # the Pool's own list of its worker processes
            if worker.is_alive():
                worker.kill()
        pool.terminate()
    pool.join()


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread (delivered at the end); what it starts
    meanwhile inherits the mask."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """stop_signals_blocked, and a stop signal's Python handler held off until the end too.

    A mask holds a signal back from this thread only: the kernel hands a process-directed
    SIGTERM to any thread that does not block it (tqdm's monitor, a reader thread), and
    Python then runs the handler in the main thread at once, inside the block. So in the
    main thread the handlers are swapped for one that notes the signal, which is raised
    again once the old handlers are back."""
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's alone
        with stop_signals_blocked():
            yield
        return
    noted: list[int] = []
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    swapped = [signum for signum, handler in handlers.items() if handler is not None]  # None: set outside Python
    try:  # a signal between two swaps still finds every handler put back
        for signum in swapped:
            signal.signal(signum, lambda signum, frame: noted.append(signum))
        with stop_signals_blocked():
            yield
    finally:
        put_back(handlers, swapped)
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)


def put_back(handlers: dict, swapped: list) -> None:
    """signal.signal(signum, handlers[signum]) for each swapped signal. A handler put back
    runs at once for a signal that comes meanwhile, and may raise: the rest still go back
    (none is left noting signals forever), and then it is raised."""
    raised = None
    for signum in swapped:
        while True:
            try:
                signal.signal(signum, handlers[signum])
                break
            except BaseException as exc:  # a KeyboardInterrupt: raised once all are back
                raised = exc
    if raised is not None:
        raise raised


def load_in_threads(jobs: list, load: Callable[[Any], Any], threads: int,
                    window: int = WINDOW_FILES, budget: int = WINDOW_BYTES) -> Iterator:
    """load(job) for every job, in order, run by `threads` threads that read ahead of the consumer.

    For I/O-bound loads: reading a file and zlib's CRC-32 release the GIL, and the bytes
    need no pickling through a pipe, which cost more than the reading itself when
    processes did this (docs/benchmarks.md, "How fast packing is"). The threads keep reading while
    the consumer is busy (an LMDB commit takes a few hundred ms), up to `window` files
    ahead of it and at most about `budget` bytes loaded and not yet consumed, so memory
    stays flat however large the dataset is. A reader stuck in a read (a hung network
    mount) is left behind after STOP_GRACE_S (they are daemon threads) rather than waited for.
    """
    if threads <= 1:
        yield from map(load, jobs)
        return
    ahead = _ReadAhead(jobs, load, window, budget)
    workers = [threading.Thread(target=ahead.work, name=f"packer-read-{i}", daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    try:
        for i in range(len(jobs)):
            yield ahead.take(i)
    finally:
        ahead.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))


class _ReadAhead:
    """Jobs handed to reader threads in order; results taken in order by one consumer.

    The consumer touches no lock a reader needs (in_order says why): results come to it
    through a queue, and all it tells the readers is how far it has got, in two counters
    only it writes. A reader ahead of it by `window` jobs or `budget` bytes looks again
    every READER_WAIT_S (idle readers cost nothing to a consumer that is behind anyway).
    Jobs are started in order, so the job the consumer waits for is always started before
    any later one: once every started job is taken no bytes wait, and the budget can
    never hold it back (no deadlock).
    """

    def __init__(self, jobs: list, load: Callable[[Any], Any], window: int, budget: int):
        self.jobs, self.load = jobs, load
        self.window, self.budget = window, max(budget, 1)
        self.finished: queue.SimpleQueue = queue.SimpleQueue()  # (index, result), as each is loaded
        self.lock = threading.Lock()  # the readers' alone
        self.started = 0        # jobs handed to a reader (under lock)
        self.loaded_bytes = 0   # of every result loaded so far (under lock)
        self.taken = 0          # results taken by the consumer (the consumer's)
        self.taken_bytes = 0    # their bytes (the consumer's)
        self.arrived: dict = {}  # results loaded ahead of the one the consumer waits for (the consumer's)
        self.stopped = False

    def work(self) -> None:
        while (index := self._next_job()) is not None:
            try:
                result = self.load(self.jobs[index])
            except BaseException as exc:  # re-raised in the consumer, which knows what to do
                result = exc
            with self.lock:
                self.loaded_bytes += _loaded_bytes(result)
            self.finished.put((index, result))

    def _next_job(self) -> int | None:
        """The next job to load, once it is within the window and the budget; None when stopped or done."""
        while True:
            with self.lock:
                if self.stopped or self.started >= len(self.jobs):
                    return None
                if self.started - self.taken < self.window and self.loaded_bytes - self.taken_bytes < self.budget:
                    self.started += 1
                    return self.started - 1
            time.sleep(READER_WAIT_S)

    def take(self, index: int):
        """Result index; a failed load's exception is raised (the consumer then stops)."""
        result = in_order(self.finished, self.arrived, index)
        self.taken_bytes += _loaded_bytes(result)
        self.taken = index + 1
        return result

    def stop(self) -> None:
        self.stopped = True
        self.arrived.clear()


def _loaded_bytes(result) -> int:
    """The bytes a loaded result holds in memory (what the read-ahead budget counts): its
    `data`, where it has any."""
    data = getattr(result, "data", None)
    return len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0


# Set once in each pool worker, so that load is not pickled again with every task.
_load: Callable[[Any], Any] | None = None


def _start_worker(load: Callable[[Any], Any]) -> None:
    # Ctrl-C reaches the whole process group, and a scheduler's SIGTERM every process of
    # the job. A worker killed by either can die holding one of the pool's queue locks, and
    # then the parent's Pool.terminate() waits forever: the parent stops its workers.
    ignore_stop_signals()
    escape_warnings()
    global _load
    _load = load


def escape_warnings() -> None:
    """In a worker process: its warnings name dataset paths too, and it prints them itself
    (a process started by spawn or forkserver, Python 3.14's default, does not inherit the
    command's escaping, as a forked one does)."""
    warnings.formatwarning = escaping(warnings.formatwarning)


def _load_part(jobs: list) -> list:
    return [_load(job) for job in jobs]
