"""An IterableDataset (readers.WDSDataset) read by thread workers (worker_kind="threads").

A stream cannot be read by index, so its threads do what DataLoader worker processes do:
thread w of W iterates its own copy of the dataset (unpickled from the trainer's, as a
spawned worker receives it) as worker w of W (readers.ranks.worker answers so on that
thread), and writes each sample into its batch's ring slot as it reads it
(readers.slot_fill); the trainer
takes the batches round-robin over the threads whose streams have not ended, worker 0
first, as DataLoader does. So the batches, their order and the loader's state are those
of W worker processes, and a state saved with either resumes with the other.

Each thread runs at most `credit` batches ahead of the trainer: the trainer grants one
more each time it takes one of that thread's. A new pass, or the process's end, stops
the threads of the pass before (within POLL seconds).
"""
from __future__ import annotations

import itertools
import pickle
import threading

import torch

from .ranks import as_worker

POLL = 1.0  # seconds a stream thread waits for credit before it checks that its pass goes on


class StreamPass:
    """The background process's side of one pass over a stream: W threads, each a worker."""

    def __init__(self, run: int, blob: bytes, workers: int, batch_size: int, drop_last: bool, credit: int,
                 new_fill, send):
        self.run, self.stopped = run, threading.Event()
        self.credits = [threading.Semaphore(credit) for _ in range(workers)]
        self.threads = [threading.Thread(target=self.read,
                                         args=(blob, w, workers, batch_size, drop_last, new_fill, send),
                                         name=f"packer-stream-{w}", daemon=True) for w in range(workers)]
        for thread in self.threads:
            thread.start()

    def grant(self, worker_id: int) -> None:
        if 0 <= worker_id < len(self.credits):
            self.credits[worker_id].release()

    def stop(self) -> None:
        self.stopped.set()

    def read(self, blob: bytes, worker_id: int, workers: int, batch_size: int, drop_last: bool, new_fill,
             send) -> None:
        """Thread worker_id's stream, in batches: send(worker_id, ok, slot, batch) for each,
        ok None at its end, False with a message for an error (that ends it too)."""
        as_worker(worker_id, workers)
        torch.set_num_threads(1)
        made = 0
        try:
            samples = iter(pickle.loads(blob))
            while self.wait_for_credit(worker_id):
                fill, rows = new_fill(batch_size), 0
                try:
                    for rows, sample in enumerate(itertools.islice(samples, batch_size), 1):
                        fill.put(rows - 1, sample)
                except BaseException:
                    fill.give_back()
                    raise
                if not rows or (drop_last and rows < batch_size):
                    fill.give_back()
                    send(worker_id, None, -1, None)
                    return
                send(worker_id, True, *fill.result(rows))
                made += 1
        except Exception as error:
            send(worker_id, False, -1, f"thread worker {worker_id} of {workers}: the stream's batch {made} failed: "
                                       f"{type(error).__name__}: {error}")

    def wait_for_credit(self, worker_id: int) -> bool:
        """Whether this thread may make its next batch: False once its pass is stopped."""
        while not self.credits[worker_id].acquire(timeout=POLL):
            if self.stopped.is_set():
                return False
        return not self.stopped.is_set()


def round_robin(workers: int, next_of):
    """(worker, item) in DataLoader's order: worker 0, 1, ..., W-1, 0, ... skipping a worker
    whose stream has ended. next_of(w) is w's next (ok, slot, payload), ok None at its end."""
    active, turn = list(range(workers)), 0
    while active:
        worker_id = active[turn]
        item = next_of(worker_id)
        if item[0] is None:
            del active[turn]
        else:
            yield worker_id, item
            turn += 1
        if active:
            turn %= len(active)
