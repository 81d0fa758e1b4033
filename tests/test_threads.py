"""Thread workers (readers.threads, make_loader's worker_kind): the same batches in the same
order as worker processes for every format and order; states saved with processes resume
with threads and back, in new processes; a failing sample names its index; a killed
background process is reported; the trainer's SIGINT, SIGTERM and SIGKILL end the
background process and leave nothing in /dev/shm.

The new processes run this file as a script: `python tests/test_threads.py MODE ...`.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers

import readers  # noqa: E402
from readers import make_loader  # noqa: E402

from readers.threads import inline_batches  # noqa: E402

from bytecode_stops import interrupted_at_every_bytecode  # noqa: E402
from conftest import packed_three_ways, sample_ids  # noqa: E402

BATCH, SEED, THREADS = 5, 3, 2
PACKS = {"lmdb": ("d.lmdb", readers.LMDBDataset), "hdf5": ("d.h5", readers.HDF5Dataset),
         "wdsmap": ("d.wds", readers.WDSMapDataset)}
KINDS = ("processes", "threads-inline", "threads")


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    return packed_three_ways(tmp_path_factory.mktemp("threads"))


def loader(root: str, fmt: str, order: str, kind: str, **options):
    name, kind_of = PACKS[fmt]
    data = kind_of(Path(root) / name, decode="raw")
    return make_loader(data, BATCH, workers=THREADS, seed=SEED, order=order, block_size=4, window=3,
                       collate_fn=sample_ids, worker_kind=kind, **options)


@pytest.mark.parametrize("fmt,order", [("lmdb", "random"), ("hdf5", "block"), ("wdsmap", "sequential")])
def test_threads_yield_the_batches_processes_yield_in_their_order(packs, fmt, order):
    expected = [list(loader(packs, fmt, order, "processes"))]
    for kind in ("threads-inline", "threads"):
        got = loader(packs, fmt, order, kind)
        passes = [list(got), list(got)]
        assert passes[0] == expected[0], kind
        assert passes[1] != passes[0] or order == "sequential", kind  # the epoch advances


def test_tensor_batches_cross_from_the_background_process(packs):
    data = readers.LMDBDataset(Path(packs) / "d.lmdb", decode="numpy")
    seen = {kind: list(make_loader(data, BATCH, workers=THREADS, train=False, worker_kind=kind)) for kind in KINDS}
    for kind in KINDS[1:]:
        assert len(seen[kind]) == len(seen["processes"]) == 20
        for (images, labels), (want_images, want_labels) in zip(seen[kind], seen["processes"]):
            assert torch.equal(images, want_images) and torch.equal(labels, want_labels), kind


def test_a_ctrl_c_at_any_bytecode_of_taking_an_inline_batch_leaves_no_thread_behind(packs):
    # threads-inline: the trainer's own thread submits and takes batches. A KeyboardInterrupt
    # just after Future.result() or the pool's submit took a lock left it held; the pool's
    # threads then waited on it, and the loader's shutdown (at the trainer's exit) on them.
    data = readers.LMDBDataset(Path(packs) / "d.lmdb", decode="raw")
    batches = [list(range(i, i + BATCH)) for i in range(0, len(data), BATCH)]
    places = interrupted_at_every_bytecode(lambda: inline_batches(data, batches, sample_ids, THREADS, 2),
                                           spared=("submit_batch", "settled"))
    assert len(places) >= 10 and any("in_order" in place for place in places), places
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("packer-loader")]


class Closing:
    """A loader's pass as an iterator whose close() ends the loader's workers too."""

    def __init__(self, loader):
        self.loader, self.batches = loader, iter(loader)

    def __next__(self):
        return next(self.batches)

    def close(self) -> None:
        self.batches = None
        self.loader.close_workers()


def test_a_ctrl_c_at_any_bytecode_of_taking_a_background_batch_leaves_no_process_behind(packs):
    # threads: the trainer asks its background process for batches through a multiprocessing
    # Queue, whose put takes a lock its feeder thread needs: a KeyboardInterrupt just after it
    # left it held, and the request that closes the process then waited on it forever.
    data = readers.LMDBDataset(Path(packs) / "d.lmdb", decode="raw")
    places = interrupted_at_every_bytecode(lambda: Closing(make_loader(
        data, BATCH, workers=THREADS, worker_kind="threads", collate_fn=sample_ids, train=False)), spared=("ask",))
    assert len(places) >= 10 and any("receive" in place for place in places), places
    assert multiprocessing.active_children() == []


def save(root: str, kind: str, k: int, path: Path) -> list:
    """Run epoch 0 whole and k batches of epoch 1 with `kind`, save the state; returns the batches."""
    made = loader(root, "lmdb", "random", kind)
    first = list(made)
    batches = iter(made)
    head = [next(batches) for _ in range(k)]
    torch.save(made.state_dict(), path)
    del batches
    return [first, head]


def test_a_state_saved_with_processes_resumes_with_threads_and_back(packs, tmp_path):
    full = loader(packs, "lmdb", "random", "processes")
    whole = [list(full), list(full), list(full)]
    k = 3
    jobs = []
    for saved, resumed in (("processes", "threads-inline"), ("processes", "threads"),
                           ("threads-inline", "processes"), ("threads", "processes"), ("threads", "threads-inline")):
        path = tmp_path / f"{saved}-{resumed}.pt"
        first, head = save(packs, saved, k, path)
        assert first == whole[0] and head == whole[1][:k], saved
        jobs.append({"saved": saved, "resumed": resumed, "state": str(path)})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run_script("resume", packs, tmp_path / "jobs.json")
    results = json.loads((tmp_path / "jobs.json.out").read_text())
    for job, (rest, following) in zip(jobs, results):
        name = f"saved with {job['saved']}, resumed with {job['resumed']}"
        assert whole[1][:k] + rest == whole[1], name
        assert following == whole[2], name


def resume_jobs(root: str, path: str) -> None:
    """Script side of the test above: each saved state loaded into a new loader of the other kind."""
    results = []
    for job in json.loads(Path(path).read_text()):
        made = loader(root, "lmdb", "random", job["resumed"])
        made.load_state_dict(torch.load(job["state"], weights_only=True))
        results.append([list(made), list(made)])
    Path(path + ".out").write_text(json.dumps(results))


def test_an_elastic_resume_from_two_ranks_of_processes_to_one_of_threads(packs, monkeypatch):
    """Two ranks (RANK/WORLD_SIZE) hand out 3 batches each with worker processes; rank 0's
    state, loaded on one rank with threads, yields every sample no rank handed out, once."""
    k, handed = 3, []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        made = loader(packs, "lmdb", "random", "processes", drop_last=False)
        batches = iter(made)
        handed += [s for _ in range(k) for s in next(batches)]
        if rank == 0:
            state = made.state_dict()
        del batches
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    everything = [s for batch in loader(packs, "lmdb", "random", "processes", drop_last=False) for s in batch]
    for kind in ("threads-inline", "threads"):
        resumed = loader(packs, "lmdb", "random", kind, drop_last=False)
        resumed.load_state_dict(state)
        rest = [s for batch in resumed for s in batch]
        assert sorted(rest) == sorted(set(everything) - set(handed)), kind


class Failing(torch.utils.data.Dataset):
    """Samples 0..n-1; sample `bad` raises, as a corrupt record would."""

    def __init__(self, n: int, bad: int):
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        if index == self.bad:
            raise ValueError("not a JPEG")
        return torch.full((4,), index)


@pytest.mark.parametrize("kind", KINDS[1:])
@pytest.mark.parametrize("bad", [1, 17])  # in the first batch (read by both threads) or a later one
def test_a_failing_sample_surfaces_in_the_trainer_with_its_index(kind, bad):
    made = make_loader(Failing(40, bad=bad), 4, workers=THREADS, train=False, worker_kind=kind)
    with pytest.raises(RuntimeError, match=rf"sample {bad} of Failing failed: ValueError: not a JPEG"):
        list(made)


class Slow(Failing):
    def __getitem__(self, index: int):
        time.sleep(0.05)
        return super().__getitem__(index), index  # an (image, label) pair: packer's collate


def test_a_killed_background_process_is_reported_within_the_bound():

    from readers.threads import POLL

    before = set(multiprocessing.active_children())
    batches = iter(make_loader(Slow(400, bad=-1), 4, workers=THREADS, train=False, worker_kind="threads"))
    next(batches)
    (child,) = set(multiprocessing.active_children()) - before
    os.kill(child.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"thread-worker process \(pid {child.pid}\) exited with code -9"):
        for _ in batches:
            pass
    assert time.monotonic() - start < 10 * POLL  # the bound, with room for a loaded machine


def torch_shm(pids) -> list[str]:
    """/dev/shm entries torch made for these processes (named torch_<pid>_...)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return [n for n in names if any(n.startswith(f"torch_{pid}_") for pid in pids)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_the_trainers_signal_ends_the_background_process_and_leaves_no_shared_memory(sig, tmp_path):
    trainer = subprocess.Popen([sys.executable, __file__, "hold", str(tmp_path / "pids")], cwd=HERE.parent,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pids").exists() and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "pids").exists(), f"the trainer never took a batch:\n{trainer.stderr.read()[-3000:]}"
        child = int((tmp_path / "pids").read_text().split()[1])
        assert alive(child)
        trainer.send_signal(sig)
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 15
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), f"the background process outlived the trainer's {sig.name}"
        # Counted by name: other processes on the machine may add /dev/shm entries meanwhile.
        assert torch_shm([trainer.pid, child]) == [], "shared memory left in /dev/shm"
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_trainers_signal_stops_threads_inline_mid_pass(sig, tmp_path):
    trainer = subprocess.Popen([sys.executable, __file__, "hold", str(tmp_path / "pids"), "threads-inline"],
                               cwd=HERE.parent, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pids").exists() and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "pids").exists(), f"the trainer never took a batch:\n{trainer.stderr.read()[-3000:]}"
        trainer.send_signal(sig)
        assert trainer.wait(timeout=30) != 0  # stopped, its threads with it, within the bound
    finally:
        trainer.kill()
        trainer.wait()


def hold(pids: str, kind: str = "threads") -> None:
    """Script side of the tests above: a trainer holding a batch mid-pass (in shared memory,
    from a background process), iterating on until a signal."""

    made = make_loader(Slow(4000, bad=-1), 8, workers=THREADS, train=False, worker_kind=kind)
    batches = iter(made)
    batch, _ = next(batches)
    children = [child.pid for child in multiprocessing.active_children()]
    if kind == "threads":
        assert made.background().ring.holds(batch) and len(children) == 1  # a view of its slot, not a copy
    Path(pids + ".tmp").write_text(" ".join(map(str, [os.getpid(), *children])))
    os.replace(pids + ".tmp", pids)
    for batch in batches:  # the threads busy when the signal comes
        time.sleep(0.05)


def test_worker_kind_refuses_what_threads_cannot_do(packs):
    data = readers.LMDBDataset(Path(packs) / "d.lmdb")
    with pytest.raises(ValueError, match="worker_kind must be one of processes, threads, threads-inline"):
        make_loader(data, BATCH, worker_kind="thread")
    with pytest.raises(ValueError, match="workers is the number of threads and must be an int >= 1, got 0"):
        make_loader(data, BATCH, workers=0, worker_kind="threads")
    with pytest.raises(ValueError, match="worker_init_fn applies to worker processes; with worker_kind='threads'"):
        make_loader(data, BATCH, workers=2, worker_kind="threads", worker_init_fn=print)
    with pytest.raises(ValueError, match="WDSDataset is an IterableDataset, so use worker_kind='threads' or 'processes'"):
        make_loader(readers.WDSDataset(Path(packs) / "d.wds"), BATCH, workers=2, worker_kind="threads-inline")


def test_the_benchmark_suite_measures_every_kind(packs, tmp_path, capsys):
    from benchmarks.suites import thread_workers

    out = tmp_path / "runs.json"
    assert thread_workers.main([str(Path(packs) / "d.lmdb"), "--batch", "4", "--batches", "3", "--repeats", "1",
                                "--steps", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == set(thread_workers.KINDS)
    for kind, figures in summary.items():
        assert figures["samples_per_s"] > 0 and figures["first_batch_s"] > 0 and figures["uss_mb"] > 0, kind
        assert figures["batch_memory_mb"] > 0, kind  # the trainer's batch at least
        # the loader's own processes: the workers, or the background process; none inline
        assert (figures["loader_uss_mb"] > 0) == (kind != "threads-inline"), kind
    assert "| threads-inline |" in capsys.readouterr().out


def test_the_benchmark_suite_refuses_a_pack_too_small_for_its_run_naming_what_it_needs(packs, capsys):
    from benchmarks.suites import thread_workers

    size = len(readers.LMDBDataset(Path(packs) / "d.lmdb"))
    with pytest.raises(SystemExit) as exited:
        thread_workers.main([str(Path(packs) / "d.lmdb"), "--batch", str(size), "--batches", "1"])
    assert exited.value.code == 2
    assert f"{size} samples, and a run takes 1 + 1 batches of {size} = {2 * size} in one pass" in capsys.readouterr().err


def run_script(*args, timeout: int = 180) -> None:
    done = subprocess.run([sys.executable, __file__, *map(str, args)], capture_output=True, text=True,
                          cwd=HERE.parent, timeout=timeout)
    assert done.returncode == 0, f"the new process failed:\n{done.stderr[-4000:]}"


if __name__ == "__main__":
    {"resume": resume_jobs, "hold": hold}[sys.argv[1]](*sys.argv[2:])
