"""Thread workers for make_loader (worker_kind="threads-inline" or "threads").

ThreadLoader is an EpochLoader whose batches are made by a pool of threads instead of
DataLoader worker processes. The trainer keeps the sampler, the batch sampler and the
loader's position, exactly as with process workers, so state_dict()/load_state_dict()
are the EpochLoader's own: a state saved with processes resumes with threads and back.
What moves is where a batch of indexes becomes a collated batch:

- "threads-inline": a thread pool in the trainer process. No process to start or
  import torch in, one copy of the dataset's handles; the threads share the trainer's
  GIL, so a GIL-holding step (a Python transform) slows the training loop beside it.
- "threads": one background process per rank (Background), started at the first pass
  and kept for the next ones, runs the thread pool and collates each batch into a slot
  of a ring of shared memory whose views are the trainer's batch tensors (readers.ring):
  no copy; each sample is written into its slot as it is read (readers.slot_fill), and
  the threads share one heap, trimmed after each batch (readers.heap). The process only
  reads, decodes and collates; the trainer's GIL is left to training. An IterableDataset
  is read there too, each thread as one DataLoader worker (readers.thread_streams).

Batches come out in the sampler's order, at most `prefetch` batches ahead of the
consumer. Every wait is bounded: a background process that dies is reported within
POLL seconds; one whose trainer dies (SIGKILL included) exits within POLL seconds, and
the ring (a memfd) and torch's file-descriptor sharing leave no name in /dev/shm to
clean up. A sample that raises surfaces in the trainer as a RuntimeError naming its index.
"""
from __future__ import annotations

import collections
import functools
import itertools
import os
import pickle
import queue
import signal
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.multiprocessing as tmp
import torch.utils.data as tud
from torch.utils.data._utils.pin_memory import pin_memory as pin_batch

from packer.engine import STOP_LOOK_S, stop_signals_deferred

from .buffers import share_batches
from .heap import share_one_heap, trim_heap
from .ring import Ring, Slots, Taken, pack
from .slot_fill import SlotFill
from .thread_streams import StreamPass, round_robin

WORKER_KINDS = ("processes", "threads", "threads-inline")
# Seconds between checks that the other side is alive: the bound on noticing a death.
POLL = 1.0
# Seconds a background process may take to start and hand back its first batch
# (importing torch under load) before the trainer gives up on it.
START_LIMIT = 120.0
# Ring slots beyond those in flight: the batch in the trainer's hands and the one before it,
# still bound to the loop's variables while the next is taken.
HELD = 2
# Samples a thread reads together (their reads hinted to the kernel together, as
# readers.sampler.HINT_CHUNK) before writing them into their batch's slot.
FILL_CHUNK = 16


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


def submit_batch(pool: ThreadPoolExecutor, dataset, indexes: list, collate_fn, parts: int = 1,
                 new_fill=None) -> Future:
    """A future of one collated batch. parts > 1 splits its reading among that many threads
    (a pass's first batch: it then arrives `parts` times sooner), finished by the thread
    that reads the last part; otherwise one thread makes the whole batch. new_fill(size):
    a readers.slot_fill.SlotFill that each sample is written into as it is read (the
    background process's), whose result() is the future's, instead of collate_fn."""
    read, finish, abandon = batch_steps(dataset, indexes, collate_fn, new_fill)
    if parts <= 1 or len(indexes) < 2:
        return pool.submit(made_whole, read, finish, abandon, indexes)
    size = -(-len(indexes) // parts)
    reads = [pool.submit(read, indexes[i:i + size], i) for i in range(0, len(indexes), size)]
    batch, left, lock = Future(), [len(reads)], threading.Lock()
    batch.set_running_or_notify_cancel()  # begun: not to be cancelled once a part may hold a ring slot

    def part_done(_) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            batch.set_result(finish([read.result() for read in reads]))
        except BaseException as error:  # a part's SampleError, or its cancellation at shutdown
            abandon()
            batch.set_exception(error)

    for read in reads:
        read.add_done_callback(part_done)
    return batch


def batch_steps(dataset, indexes: list, collate_fn, new_fill):
    """(read(part, start), finish(what the parts read), abandon()) for one batch."""
    if new_fill is None:
        return (lambda part, start: read_samples(dataset, part),
                lambda parts: collated([s for part in parts for s in part], indexes, collate_fn), lambda: None)
    fill = new_fill(len(indexes))
    return (lambda part, start: fill_part(dataset, part, start, fill),
            lambda parts: collated_fill(fill, indexes), fill.give_back)


def made_whole(read, finish, abandon, indexes: list):
    try:
        return finish([read(indexes, 0)])
    except BaseException:
        abandon()
        raise


def fill_part(dataset, indexes: list, start: int, fill) -> None:
    """The samples at `indexes` (the batch's rows from `start`), each written into `fill`
    as it is read, FILL_CHUNK at a time: a thread holds that many, not the whole batch."""
    for at in range(0, len(indexes), FILL_CHUNK):
        chunk = indexes[at:at + FILL_CHUNK]
        for k, sample in enumerate(read_samples(dataset, chunk)):
            try:
                fill.put(start + at + k, sample)
            except Exception as error:
                raise SampleError(f"thread worker: collating sample {chunk[k]} into its batch failed: "
                                  f"{type(error).__name__}: {error}") from error


def collated_fill(fill, indexes: list):
    try:
        return fill.result()
    except Exception as error:
        raise SampleError(f"thread worker: collating the batch of samples {indexes} failed: "
                          f"{type(error).__name__}: {error}") from error


def read_one(dataset, index):
    try:
        return dataset[index]
    except Exception as error:
        raise SampleError(f"thread worker: sample {index} of {type(dataset).__name__} failed: "
                          f"{type(error).__name__}: {error}") from error


def in_order(pool: ThreadPoolExecutor, threads: int, batches, dataset, collate_fn, prefetch: int):
    """The collated batches of `batches` (lists of indexes), in order, with at most
    `prefetch` of them submitted ahead of the one handed out; the first read by every thread.

    The trainer's Ctrl-C or SIGTERM is held off while a batch is submitted or taken (at
    most STOP_LOOK_S at a time): both take locks the pool's threads need (the pool's idle
    count, the future's condition), and a KeyboardInterrupt raised just after one is taken
    leaves it held, so the threads, and the shutdown that waits for them, would hang."""
    pending = collections.deque()
    batches = iter(batches)
    for indexes in batches:
        parts = 1 if pending else threads
        with stop_signals_deferred():
            pending.append(submit_batch(pool, dataset, list(indexes), collate_fn, parts))
        if len(pending) >= prefetch:
            break
    while pending:
        batch = settled(pending.popleft())
        for indexes in batches:
            with stop_signals_deferred():
                pending.append(submit_batch(pool, dataset, list(indexes), collate_fn))
            break
        yield batch


def settled(future: Future):
    """future.result(), waited for STOP_LOOK_S at a time with stop signals held off (in_order)."""
    while True:
        with stop_signals_deferred():
            try:
                return future.result(timeout=STOP_LOOK_S)
            except FutureTimeout:
                if future.done():  # the batch's own TimeoutError, not the wait's
                    raise


class ThreadBatches(tud.DataLoader):
    """The batch source under EpochLoader's pass: DataLoader.__iter__ replaced by thread
    workers (ThreadLoader puts it after EpochLoader in its bases, so EpochLoader's
    super().__iter__() lands here)."""

    threads: int = 1
    kind: str = "threads-inline"
    prefetch: int = 2
    pin: bool = False
    context = None  # the background process's multiprocessing context (None: fork, or spawn after CUDA)
    _background = None  # "threads": the Background, kept across passes
    _closer = None  # its weakref.finalize: ends it when the loader goes

    def __iter__(self):
        batches = self._index_sampler  # the batch sampler, resumed by load_state_dict
        if self.kind == "threads-inline":
            return inline_batches(self.dataset, batches, self.collate_fn, self.threads, self.prefetch)
        if isinstance(self.dataset, tud.IterableDataset):
            # Pickled now, as DataLoader's workers take their copies when a pass begins: with
            # the position a loaded state left on it, which EpochLoader then clears.
            return self.background().stream(pickle.dumps(self.dataset), self.threads, self.batch_size,
                                            self.drop_last, self.prefetch, self.pin)
        # EpochLoader's pass has set its epoch on the trainer's dataset: the process's copy follows.
        progress = getattr(self, "_progress", None)
        return self.background().batches(batches, self.prefetch, progress and progress[0], self.pin)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_background"] = state["_closer"] = None  # a copy (a pickled loader) starts its own
        return state

    def background(self) -> Background:
        """The background process, started at the first pass and kept for the next ones
        (a new one after one has died); ended with the loader, or by close_workers()."""
        if self._background is None or not self._background.process.is_alive():
            self.close_workers()
            self._background = Background(self.dataset, self.collate_fn, self.threads, self.prefetch + HELD,
                                          self.context)
            self._closer = weakref.finalize(self, self._background.close)
        return self._background

    def close_workers(self) -> None:
        """End the background process now (the next pass starts a new one)."""
        if self._closer is not None:
            self._closer()
        self._background = self._closer = None


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


class Background:
    """One rank's background process of thread workers, kept from pass to pass, and the
    ring of batch slots it fills (readers.ring). Each pass is numbered: batches of a pass
    broken off that arrive later are dropped and their slots given back."""

    def __init__(self, dataset, collate_fn, threads: int, slots: int, context):
        if context is None:  # fork starts soonest, but is unsafe once CUDA is initialised here
            context = "spawn" if torch.cuda.is_initialized() else "fork"
        ctx = tmp.get_context(context) if isinstance(context, str) else context
        self.ring = Ring(slots)
        self.taken = Taken(self.ring)
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=serve, args=(dataset, collate_fn, threads, self.ring, self.requests,
                                                       self.results, os.getpid()),
                                   daemon=True, name="packer-thread-loader")
        self.process.start()
        self.passes, self.answered = 0, False

    def batches(self, batches, prefetch: int, epoch, pin: bool):
        """One pass: the trainer sends each batch's indexes (numbered), the process's
        threads collate them into slots, the trainer hands them out in order."""
        self.passes += 1
        run = self.passes
        ask(self.requests, ("pass", run, epoch, self.taken.dropped()))
        batches, sent, taken, done = iter(batches), 0, 0, {}
        try:
            for indexes in itertools.islice(batches, prefetch):
                ask(self.requests, ("batch", run, sent, list(indexes), []))
                sent += 1
            while taken < sent:
                while taken not in done:
                    self.arrived(run, done.__setitem__)
                ok, slot, payload = done.pop(taken)
                taken += 1
                if not ok:
                    raise SampleError(payload)
                batch = self.taken.unpack(payload, slot)
                if pin:  # copied into pinned memory (readers.ring): the slot is free once the view goes
                    batch = pin_batch(batch)
                for indexes in itertools.islice(batches, 1):
                    ask(self.requests, ("batch", run, sent, list(indexes), self.taken.dropped()))
                    sent += 1
                yield batch
        finally:  # batches received but not handed out give their slots back
            left = [slot for _, slot, _ in done.values() if slot >= 0]
            if left and self.process.is_alive():
                ask(self.requests, ("free", left))

    def stream(self, blob: bytes, workers: int, batch_size: int, drop_last: bool, prefetch: int, pin: bool):
        """One pass over a stream (readers.thread_streams): `workers` threads read the
        dataset pickled as `blob`, each as one DataLoader worker; taken round-robin."""
        self.passes += 1
        run, done = self.passes, {w: collections.deque() for w in range(workers)}
        credit = max(1, prefetch // workers)
        ask(self.requests, ("stream", run, blob, workers, batch_size, drop_last, credit, self.taken.dropped()))

        def next_of(worker_id: int):
            while not done[worker_id]:
                self.arrived(run, lambda key, answer: done[key].append(answer))
            return done[worker_id].popleft()

        try:
            for worker_id, (ok, slot, payload) in round_robin(workers, next_of):
                if not ok:
                    raise SampleError(payload)
                batch = self.taken.unpack(payload, slot)
                ask(self.requests, ("credit", run, worker_id, self.taken.dropped()))
                yield pin_batch(batch) if pin else batch
        finally:
            left = [slot for arrived in done.values() for _, slot, _ in arrived if slot >= 0]
            if self.process.is_alive():
                ask(self.requests, ("free", left))

    def arrived(self, run: int, keep) -> None:
        """Receive one answer and keep(number or stream worker, (ok, slot, batch)) it; one
        of an earlier pass gives its slot back at once."""
        run_of, key, ok, slot, payload = receive(self.results, self.process, first=not self.answered)
        self.answered = True
        if run_of == run:
            keep(key, (ok, slot, payload))
        elif slot >= 0:
            ask(self.requests, ("free", [slot]))

    def close(self) -> None:
        stop(self.process, self.requests, self.results)
        self.ring.close()


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


def ask(requests, message) -> None:
    """requests.put(message) with the trainer's stop signals held off: a multiprocessing
    Queue's put takes a lock its feeder thread needs, and a KeyboardInterrupt raised just
    after it is taken leaves it held; the closing request would then wait on it forever."""
    with stop_signals_deferred():
        requests.put(message)


def stop(process, requests, results) -> None:
    """Ask the process to end, then make sure it has (bounded), and drop the queues."""
    try:
        ask(requests, None)
    except (OSError, ValueError):
        pass
    process.join(timeout=5 * POLL)
    if process.is_alive():
        process.kill()
        process.join(timeout=5 * POLL)
    for q in (requests, results):
        q.cancel_join_thread()
        q.close()


def serve(dataset, collate_fn, threads: int, ring: Ring, requests, results, trainer: int) -> None:
    """The background process: collate each requested batch on the thread pool (or each
    stream's, on its own threads) into a free slot of the ring and send it back. Ctrl-C
    is the trainer's to handle (it stops this process); a trainer that vanishes ends it
    within POLL seconds."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # the pool is the parallelism
    one_heap = share_one_heap()  # the threads' freed samples go back between batches, not kept per thread
    share_batches()  # a batch with no free slot: collated straight into shared memory
    with ThreadPoolExecutor(threads, thread_name_prefix="packer-loader", initializer=one_intra_op_thread) as pool:
        server = Server(dataset, collate_fn, threads, ring, results, pool, trim_heap if one_heap else None)
        while True:
            try:
                request = requests.get(timeout=POLL)
            except queue.Empty:
                if os.getppid() != trainer:
                    os._exit(0)  # orphaned: the trainer is gone
                continue
            if request is None:
                break
            server.handle(request)
        server.end_stream()
    # The trainer has taken every batch it asked for before it says stop; one that broke
    # off early wants none of the rest, so do not wait to flush them.
    results.cancel_join_thread()


class Server:
    """The background process's requests, answered: ("pass", run, epoch, freed) begins a
    pass by index, ("batch", run, number, indexes, freed) asks for one of its batches;
    ("stream", run, dataset pickled, workers, batch_size, drop_last, credit, freed) begins
    a pass over a stream, ("credit", run, worker, freed) lets one of its threads run one
    batch further; ("free", freed) gives slots back. `freed`: slots the trainer is done with.
    Each answer is (run, number or worker, ok, slot, batch): ok False with a message for
    an error, None at a stream's end."""

    def __init__(self, dataset, collate_fn, threads: int, ring: Ring, results, pool: ThreadPoolExecutor,
                 after_batch=None):
        self.dataset, self.threads, self.ring, self.results, self.pool = dataset, threads, ring, results, pool
        self.after_batch = after_batch  # called by a thread once it has sent a batch (readers.heap.trim_heap)
        self.slots = Slots(ring.slots)
        self.new_fill = functools.partial(SlotFill, collate_fn=collate_fn, ring=ring, slots=self.slots)
        self.pending: dict[tuple, Future] = {}  # (pass, number): batches not yet sent
        self.stream: StreamPass | None = None

    def handle(self, request: tuple) -> None:
        for slot in request[-1]:
            self.slots.give(slot)
        kind, args = request[0], request[1:-1]
        if kind in ("pass", "stream"):
            self.end_stream()
            for (run_of, _), batch in list(self.pending.items()):
                if run_of != args[0]:
                    batch.cancel()  # what earlier passes asked for and no thread has begun
        if kind == "pass" and args[1] is not None and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(args[1])  # the epoch the trainer set on its own copy
        elif kind == "batch":
            run, number, indexes = args
            self.pending[(run, number)] = batch = submit_batch(self.pool, self.dataset, indexes, None,
                                                               self.threads if number == 0 else 1, self.new_fill)
            batch.add_done_callback(functools.partial(self.sent, run, number))
        elif kind == "stream":
            run, blob, workers, batch_size, drop_last, credit = args
            self.stream = StreamPass(run, blob, workers, batch_size, drop_last, credit, self.new_fill,
                                     functools.partial(self.send, run))
        elif kind == "credit" and self.stream is not None and self.stream.run == args[0]:
            self.stream.grant(args[1])

    def end_stream(self) -> None:
        if self.stream is not None:
            self.stream.stop()
            self.stream = None

    def sent(self, run: int, number: int, batch: Future) -> None:
        self.pending.pop((run, number), None)
        try:
            slot, made = batch.result()
        except BaseException as error:
            self.send(run, number, False, -1, str(error))
        else:
            self.send(run, number, True, slot, made)

    def send(self, run: int, key: int, ok, slot: int, made) -> None:
        """Answer (thread-safe: the queue's feeder thread sends it); a batch goes packed (readers.ring)."""
        if ok:
            try:
                made = pack(made, self.ring, slot)
            except BaseException as error:
                if slot >= 0:
                    self.slots.give(slot)
                ok, slot, made = False, -1, f"thread worker: sending batch {key} failed: {type(error).__name__}: {error}"
        self.results.put((run, key, ok, slot, made))
        if self.after_batch is not None:
            self.after_batch()

