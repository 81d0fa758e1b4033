"""Counts pooled among the DataLoader workers of one rank, through shared memory its main
process made before starting them (inherited under fork, passed under spawn): how a
worker handed only its own saved state (torchdata's StatefulDataLoader hands each its
own) learns its peers', which together are the rank's position.

One 64-bit word per worker, written only by that worker, each in one store: the rank
(+1, so an empty slot is 0), the count, and a phase: 1 posted, 2 read. A worker posts,
waits for every peer's post, reads them, marks its slot read, waits until every peer has
read (or cleared, having seen all read), then clears its slot. So every slot is empty
again before the workers report that they have started, and the next pool of this
dataset starts from empty slots; a slot its owner finds held by its rank was left by a
worker stopped mid-way, and its owner refuses (clearing it), which fails the whole start,
so no peer goes on with a stale count. A slot of another rank means ranks share the
dataset object: refused. Every wait is bounded by the clock.
"""
from __future__ import annotations

import multiprocessing
import time

SLOTS = 512  # DataLoader workers per rank that can pool: 4 KB of shared memory per dataset
WAIT_S = 120.0  # the peers start together; this bounds a peer's start-up (spawn imports torch)
COUNT_BITS = 30
POSTED, READ = 1, 2


class CountPool:
    """SLOTS shared words; pool() is called once by each of a rank's `workers` DataLoader workers."""

    def __init__(self):
        self.words = multiprocessing.Array("q", SLOTS, lock=False)

    def pool(self, rank: int, worker_id: int, workers: int, count: int, wait_s: float = WAIT_S) -> list[int]:
        """Every worker's count, in worker order, once each of the `workers` has posted its own."""
        if workers > SLOTS:
            raise ValueError(f"WDSDataset: {workers} DataLoader workers cannot pool their saved positions (at most "
                             f"{SLOTS}); resume with at most {SLOTS} workers, or on the ranks that saved the state")
        if not 0 <= count < 1 << COUNT_BITS:
            raise ValueError(f"WDSDataset: a stream count of {count} is past what workers can pool (2**{COUNT_BITS})")
        tag = (rank + 1) << 32
        held = self.words[worker_id]
        if held >> 32 == rank + 1:  # this rank's worker was stopped mid-way: no peer may read it again
            self.words[worker_id] = 0
            raise ValueError(stopped_message(rank, worker_id))
        if held:
            raise ValueError(shared_message(rank, worker_id, held))
        try:
            self.words[worker_id] = tag | count << 2 | POSTED
            words = self.wait(rank, workers, lambda word: word & 3 in (POSTED, READ), wait_s, "post its count")
            self.words[worker_id] = tag | count << 2 | READ
            self.wait(rank, workers, lambda word: word == 0 or word & 3 == READ, wait_s, "read the counts")
        finally:
            self.words[worker_id] = 0
        return [word >> 2 & (1 << COUNT_BITS) - 1 for word in words]

    def wait(self, rank: int, workers: int, ready, wait_s: float, what: str) -> list[int]:
        """The first `workers` words once ready() holds for each; a word of another rank is refused."""
        deadline = time.monotonic() + wait_s
        while True:
            words = self.words[:workers]
            foreign = [w for w, word in enumerate(words) if word and word >> 32 != rank + 1]
            if foreign:
                raise ValueError(shared_message(rank, foreign[0], words[foreign[0]]))
            missing = [w for w, word in enumerate(words) if not ready(word)]
            if not missing:
                return words
            if time.monotonic() > deadline:
                raise ValueError(f"WDSDataset: resuming on other ranks, DataLoader worker(s) "
                                 f"{', '.join(map(str, missing))} of {workers} on rank {rank} did not {what} within "
                                 f"{wait_s:.0f} s; each worker holds one part of the saved position, so all must "
                                 "start together (is a worker stuck, was the loader's state loaded into a loader "
                                 "with other workers, or do an earlier failed start's workers still hold slots? "
                                 "then make a new WDSDataset for the retry)")
            time.sleep(0.002)


def stopped_message(rank: int, worker_id: int) -> str:
    return (f"WDSDataset: DataLoader worker {worker_id} of rank {rank} found its slot for pooling saved positions "
            "still held: an earlier resume's worker was stopped mid-way; the slot is cleared now, so start the "
            "loader again, over a new WDSDataset (the failed start's other workers may hold its slots up to "
            f"{WAIT_S:.0f} s more)")


def shared_message(rank: int, worker_id: int, word: int) -> str:
    return (f"WDSDataset: DataLoader worker {worker_id} of rank {(word >> 32) - 1} pools its saved position with rank "
            f"{rank}'s workers: one WDSDataset object is shared by ranks (made before they were spawned); make one "
            "in each rank")
