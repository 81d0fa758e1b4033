"""readers.heap: a DataLoader worker keeps its freed heap between batches, the main process is left alone, a
thread-worker process allocates from one heap."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.utils.data as tud

import readers
from packer import pack
from readers import FolderDataset, WDSDataset, heap

from conftest import class_sorted_tree, jpeg_bytes, write

pytestmark = pytest.mark.skipif(heap.glibc() is None, reason="readers.heap sets glibc's malloc thresholds; "
                                                              "this C library is not glibc")


@pytest.fixture(autouse=True)
def glibc_malloc_untuned(monkeypatch):
    """No MALLOC_* setting in the environment these tests' processes inherit: readers.heap
    leaves a tuned malloc alone, and Dask's LocalCluster (tests/test_dask.py) sets
    MALLOC_TRIM_THRESHOLD_ in the process that starts it."""
    for name in [name for name in os.environ if name.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

# A worker's batch in miniature: 256 samples of ~100 KB alive together, then freed together.
# Prints the minor page faults of the cycles after the first, and what keep_heap() said.
BATCH_CYCLES = """
import json, resource, sys
from readers import heap
kept = heap.keep_heap() if sys.argv[1] == "keep" else None
def cycle():
    batch = [b"x" * (90_000 + 97 * i) for i in range(256)]
    return sum(map(len, batch))
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "kept": kept}))
"""


def batch_cycles(mode: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", BATCH_CYCLES, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}, cwd=os.path.dirname(os.path.dirname(__file__)))
    return json.loads(out.stdout)


def test_a_kept_heap_serves_the_next_batch_without_faulting_its_pages_in_again():
    default, kept = batch_cycles("default"), batch_cycles("keep")
    assert kept["kept"] is True
    # Five batches of ~24 MB: glibc's defaults give the heap back after each, so its
    # ~6,000 pages fault in again every batch; kept, they are reused.
    assert default["faults"] > 5 * 3000, default
    assert kept["faults"] < default["faults"] / 10, (kept, default)


def test_packer_keep_heap_0_turns_it_off():
    off = batch_cycles("keep", {heap.ENV: "0"})
    assert off["kept"] is False
    assert off["faults"] > 5 * 3000, off


@pytest.mark.parametrize("setting", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_a_users_own_malloc_settings_stand(setting):
    tuned = batch_cycles("keep", setting)
    assert tuned["kept"] is False
    assert tuned["faults"] > 5 * 3000, tuned  # the user's small trim threshold, not packer's


# One huge batch (20 x 16 MiB, each under the mmap threshold, so on the heap), then the
# usual ones: what the worker holds afterwards, in MiB of anonymous memory.
HUGE_BATCH = """
import json, sys
from readers import heap
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
heap.keep_heap()
before = anon()
huge = [b"x" * (16 << 20) for _ in range(20)]
del huge
for _ in range(3):
    batch = [b"x" * 100_000 for _ in range(256)]
    del batch
print(json.dumps({"held_mib": anon() - before}))
"""


def test_a_huge_batch_is_given_back_not_held_for_good():
    out = subprocess.run([sys.executable, "-c", HUGE_BATCH], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    held = json.loads(out.stdout)["held_mib"]
    # 320 MiB went through the heap; what stays is under the kept threshold (128 MiB), not
    # the whole batch (a threshold of 1 GiB held all 320).
    assert held < 160, held


def test_glibc_is_looked_for_on_linux_only(monkeypatch):
    monkeypatch.setattr(heap.sys, "platform", "win32")
    assert heap.glibc() is None


def test_the_main_process_is_left_alone():
    assert tud.get_worker_info() is None
    assert heap.keep_heap_in_worker() is False
    assert heap._decided_in != os.getpid()  # not even decided: a worker forked from here decides for itself


def heap_kept(batch):
    """A collate run in the worker: whether that worker's heap is kept."""
    return heap._kept and heap._decided_in == os.getpid()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return class_sorted_tree(tmp_path_factory.mktemp("heap") / "src", classes=2, per_class=4)


@pytest.mark.parametrize("fmt", ["folder", "lmdb", "wds-stream"])
def test_a_packer_dataset_keeps_the_heap_of_the_plain_dataloaders_workers(tree, tmp_path, fmt):
    if fmt == "folder":
        dataset = FolderDataset(tree, decode="raw")
    elif fmt == "lmdb":
        pack(str(tree), "lmdb", str(tmp_path / "d.lmdb"), progress=False, workers=1)
        dataset = readers.LMDBDataset(tmp_path / "d.lmdb", decode="raw")
    else:
        pack(str(tree), "wds", str(tmp_path / "d.wds"), progress=False, workers=1)
        dataset = WDSDataset(tmp_path / "d.wds", decode="raw")
    loader = tud.DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=heap_kept)
    assert list(loader) == [True, True]
    assert heap.keep_heap_in_worker() is False  # and the main process's is not


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_make_loader_workers_keep_their_heap(tree, tmp_path, context):
    pack(str(tree), "lmdb", str(tmp_path / "d.lmdb"), progress=False, workers=1)
    dataset = readers.LMDBDataset(tmp_path / "d.lmdb", decode="raw")
    loader = readers.make_loader(dataset, 4, workers=2, collate_fn=heap_kept, multiprocessing_context=context)
    assert list(loader) == [True, True]


def worker_rss(batch) -> int:
    """A collate run in the worker: its resident memory in bytes once the batch is read."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads a worker's RSS from /proc (Linux)")
def test_a_kept_heap_stays_flat_over_many_batches(tmp_path):
    # 64 noise JPEGs of ~100 KB read in 30 batches of 256 (~25 MB each): the worker's memory
    # after the last batch is that after the third, give or take, never 30 batches' worth.
    for i in range(64):
        write(tmp_path / "src" / f"class{i % 2}" / f"{i:02d}.jpg", jpeg_bytes(i, size=(350, 300)))
    pack(str(tmp_path / "src"), "lmdb", str(tmp_path / "d.lmdb"), progress=False, workers=1)
    dataset = readers.LMDBDataset(tmp_path / "d.lmdb", decode="raw")
    assert 80_000 < len(dataset[0][0]) < 120_000
    draws = tud.RandomSampler(dataset, replacement=True, num_samples=30 * 256,
                              generator=torch.Generator().manual_seed(0))
    loader = tud.DataLoader(dataset, batch_size=256, sampler=draws, num_workers=1, collate_fn=worker_rss)
    rss = list(loader)
    assert max(rss[3:]) - rss[2] < 8 << 20, [r >> 20 for r in rss]


# Two threads allocate a batch's worth each, then glibc's malloc_stats() lists its arenas
# (on stderr): one per thread by default, only the main one after share_one_heap().
THREAD_ARENAS = """
import json, sys, threading
from readers import heap
one = heap.share_one_heap() if sys.argv[1] == "one" else None
together = threading.Barrier(2)  # both alive at once: neither can take over the other's arena
def batch():
    samples = [bytearray(150_000) for _ in range(64)]
    together.wait(timeout=60)
    del samples
    heap.trim_heap()
threads = [threading.Thread(target=batch) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
heap.glibc().malloc_stats()
print(json.dumps({"one": one}))
"""


def thread_arenas(mode: str, env: dict | None = None) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", THREAD_ARENAS, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}, cwd=os.path.dirname(os.path.dirname(__file__)))
    return json.loads(out.stdout), out.stderr


def test_the_thread_workers_process_allocates_from_one_heap():
    # each thread of a thread-worker process would otherwise keep an arena of its own
    said, arenas = thread_arenas("default")
    assert "Arena 1:" in arenas and "Arena 2:" in arenas, arenas
    said, arenas = thread_arenas("one")
    assert said["one"] is True
    assert "Arena 0:" in arenas and "Arena 1:" not in arenas, arenas


@pytest.mark.parametrize("env", [{heap.ENV: "0"}, {"MALLOC_ARENA_MAX": "4"}])
def test_one_heap_is_not_forced_where_it_is_turned_off_or_malloc_is_tuned(env):
    said, arenas = thread_arenas("one", env)
    assert said["one"] is False
    assert "Arena 1:" in arenas, arenas
