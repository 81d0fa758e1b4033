"""packer.pack's reader threads: in order, bounded read-ahead, errors and early exits."""
import threading
import time

import pytest

from packer.pack import Loaded, load_in_threads


class Recorder:
    """A load that makes job i's bytes, and records how far ahead of the consumer it ran."""

    def __init__(self, size=lambda i: 1000, delay=0.0, fail_at=None):
        self.size, self.delay, self.fail_at = size, delay, fail_at
        self.lock = threading.Lock()
        self.started = 0
        self.consumed = 0
        self.most_ahead = 0
        self.threads = set()

    def __call__(self, i):
        with self.lock:
            self.started += 1
            self.most_ahead = max(self.most_ahead, self.started - self.consumed)
            self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        if i == self.fail_at:
            raise RuntimeError(f"load failed on job {i}")
        return Loaded(bytes([i % 256]) * self.size(i), i, None)

    def consume(self, loaded):
        for item in loaded:
            with self.lock:
                self.consumed += 1
            yield item


def test_results_come_in_job_order_from_several_threads():
    load = Recorder(delay=0.001)
    jobs = list(range(300))
    out = list(load_in_threads(jobs, load, threads=4))
    assert [item.crc for item in out] == jobs
    assert all(item.data == bytes([i % 256]) * 1000 for i, item in enumerate(out))
    assert len(load.threads) > 1


def test_read_ahead_is_bounded_by_the_file_window():
    load = Recorder()
    consumed = []
    for item in load.consume(load_in_threads(list(range(200)), load, threads=4, window=10, budget=1 << 30)):
        time.sleep(0.001)  # a slow writer: the readers would run far ahead if nothing held them
        consumed.append(item.crc)
    assert consumed == list(range(200))
    assert load.most_ahead <= 10 + 1  # the +1: the consumer counts a result just after taking it


def test_read_ahead_is_bounded_by_the_byte_budget():
    # 1 MB files and a 3 MB budget: at most 3 loaded-but-unconsumed files, plus one per thread in flight.
    load = Recorder(size=lambda i: 1 << 20)
    for item in load.consume(load_in_threads(list(range(40)), load, threads=2, window=1000, budget=3 << 20)):
        time.sleep(0.002)
    assert load.most_ahead <= 3 + 2 + 1


def test_a_load_error_is_raised_in_order_after_the_results_before_it():
    load = Recorder(fail_at=7)
    got = []
    with pytest.raises(RuntimeError, match="job 7"):
        for item in load_in_threads(list(range(50)), load, threads=3):
            got.append(item.crc)
    assert got == list(range(7))


def test_stopping_early_stops_the_threads():
    load = Recorder(delay=0.001)
    before = threading.active_count()
    loaded = load_in_threads(list(range(10_000)), load, threads=4)
    assert [next(loaded).crc for _ in range(5)] == [0, 1, 2, 3, 4]
    loaded.close()  # what the writer does when it stops on a bad file
    assert threading.active_count() == before
    assert load.started < 10_000


def test_one_thread_loads_in_the_callers_thread():
    load = Recorder()
    assert [item.crc for item in load_in_threads([3, 1, 2], load, threads=1)] == [3, 1, 2]
    assert load.threads == {threading.current_thread().name}
