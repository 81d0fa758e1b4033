"""packer.pack: reader threads and processes (order, bounded read-ahead, errors, early exits),
and what reaches the writer from a hostile source (FIFOs, devices, unreadable folders)."""
import contextlib
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.formats import read_metadata
from packer import engine
from packer.engine import STOP_GRACE_S, load_in_processes, load_in_threads
from packer.pack import Loaded, load_file

from bytecode_stops import interrupted_at_every_bytecode
from conftest import jpeg_bytes, write
from test_scan import as_unprivileged, locked_tree, public_tmp  # noqa: F401  (public_tmp is a fixture)

ROOT = Path(__file__).resolve().parents[1]


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


def make_loaded(i):
    return Loaded(bytes([i % 256]), i, None)


def fail_at_13(i):
    if i == 13:
        raise RuntimeError("load failed on job 13")
    return make_loaded(i)


def test_results_come_in_job_order_from_several_processes():
    out = list(load_in_processes(list(range(1000)), make_loaded, workers=2, chunk=7))
    assert [item.crc for item in out] == list(range(1000))
    assert multiprocessing.active_children() == []


def test_a_worker_error_is_raised_in_order_and_the_workers_are_gone():
    def consume():
        got = []
        with pytest.raises(RuntimeError, match="job 13"):
            for item in load_in_processes(list(range(200)), fail_at_13, workers=2, chunk=4):
                got.append(item.crc)
        return got

    assert within(30, consume) == list(range(12))  # the chunk holding job 13 starts at 12 and fails whole
    assert multiprocessing.active_children() == []


def test_closing_the_process_loader_early_stops_its_workers():
    # What the writer does when it stops on a bad file; it used to wait on a blocked feeder.
    closed = threading.Event()

    def consume_five_and_close():
        loaded = load_in_processes(list(range(100_000)), make_loaded, workers=2, chunk=4)
        assert [next(loaded).crc for _ in range(5)] == [0, 1, 2, 3, 4]
        loaded.close()
        closed.set()

    worker = threading.Thread(target=consume_five_and_close, daemon=True)
    worker.start()
    assert closed.wait(30), "closing the loader hung"
    assert multiprocessing.active_children() == []


def first_quick_then_stuck(i):
    if i > 0:
        time.sleep(60)  # a read that hangs (a dead network mount)
    return make_loaded(i)


def test_a_stuck_worker_is_killed_after_the_grace_period():
    loaded = load_in_processes(list(range(8)), first_quick_then_stuck, workers=2, chunk=1)
    assert next(loaded).crc == 0
    within(STOP_GRACE_S + 10, loaded.close)
    assert multiprocessing.active_children() == []


def test_a_ctrl_c_at_any_bytecode_of_the_thread_consumer_leaves_no_reader_behind():
    # A Ctrl-C or SIGTERM that landed just after `with condition:` took its lock left it
    # held; the readers then waited on it, and the pack for them, forever.
    # A window of 4 keeps the readers waiting on the consumer (with none to wait on, nothing hangs).
    places = interrupted_at_every_bytecode(lambda: load_in_threads(list(range(1000)), Recorder(), threads=2, window=4))
    assert len(places) >= 10 and any("in_order" in place for place in places), places
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("packer-read-")]


def test_a_ctrl_c_at_any_bytecode_of_the_process_consumer_leaves_no_worker_behind():
    # Submitting is held off from stop signals as a whole (stop_signals_deferred); the rest
    # of the consumer must be safe at any bytecode. Waiting on a result's Event took its lock.
    places = interrupted_at_every_bytecode(
        lambda: load_in_processes(list(range(100)), make_loaded, workers=2, chunk=1), spared=("submit",))
    assert len(places) >= 10 and any("in_order" in place for place in places), places
    assert multiprocessing.active_children() == []


def test_closing_the_thread_loader_leaves_a_stuck_reader_behind_after_the_grace_period(monkeypatch):
    monkeypatch.setattr(engine, "STOP_GRACE_S", 0.5)  # 3 s in a pack
    released = threading.Event()

    def stuck_after_two(i):
        if i >= 2:
            released.wait(60)  # a read that hangs (a dead network mount), until the test ends
        return make_loaded(i)

    loaded = load_in_threads(list(range(8)), stuck_after_two, threads=2)
    try:
        assert [next(loaded).crc for _ in range(2)] == [0, 1]
        started = time.monotonic()
        within(10, loaded.close)
        assert 0.4 < time.monotonic() - started < 5
    finally:
        released.set()


# Non-regular files: a FIFO used to hang the pack forever, /dev/zero to read until memory ran out.

def run_cli(*args, timeout=60):
    """The packer CLI in a subprocess: a hang fails the test instead of stalling the suite."""
    return subprocess.run([sys.executable, "-m", "packer.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def special_tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    write(src / "cat" / "ok.jpg", jpeg_bytes(1))
    write(src / "dog" / "ok.jpg", jpeg_bytes(2))
    os.mkfifo(src / "cat" / "pipe.jpg")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "cat" / "sock.jpg"))
    os.symlink("/dev/zero", src / "cat" / "zero.jpg")
    return src


def test_a_fifo_in_src_stops_the_pack_naming_it(tmp_path):
    src = tmp_path / "src"
    write(src / "cat" / "ok.jpg", jpeg_bytes(1))
    os.mkfifo(src / "cat" / "pipe.jpg")
    out = tmp_path / "out.lmdb"
    result = run_cli("pack", src, "--to", "lmdb", "-o", out)
    assert result.returncode == 1, result.stderr
    assert "cat/pipe.jpg: not a regular file (FIFO) (pass --on-error skip to leave it out" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("check", ["header", "full"])  # reader threads, worker processes
def test_with_skip_fifos_sockets_and_devices_are_skipped_with_their_kind(tmp_path, check):
    src = special_tree(tmp_path)
    out = tmp_path / "out.lmdb"
    result = run_cli("pack", src, "--to", "lmdb", "-o", out, "--on-error", "skip", "--check", check,
                     "--workers", "2")
    assert result.returncode == 0, result.stderr
    expected = {"cat/pipe.jpg": "not a regular file (FIFO)", "cat/sock.jpg": "not a regular file (socket)",
                "cat/zero.jpg": "not a regular file (character device)"}
    for path, reason in expected.items():
        assert f"skipped {path}: {reason}" in result.stderr
    meta = read_metadata(str(out))
    assert {s["path"]: s["reason"] for s in meta.skipped} == expected
    assert meta.count == 2


def within(seconds: float, fn, *args):
    """fn(*args), failing the test if it neither returns nor raises in time (the thread is left blocked)."""
    box = {}

    def call():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"{fn.__name__}{args} did not return within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_the_open_itself_refuses_a_fifo_or_a_device(tmp_path):
    # What a file swapped after the scan meets: the check is made on the opened descriptor.
    fifo = tmp_path / "swapped.jpg"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jpg"
    os.symlink("/dev/zero", zero)
    try:
        assert within(10, load_file, str(fifo), "header").reason == "not a regular file (FIFO)"
        assert within(10, load_file, str(zero), "header").reason == "not a regular file (character device)"
    finally:
        with contextlib.suppress(OSError):  # releases an open() left blocked on the FIFO, waiting for a writer
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_file_that_holds_more_than_its_size_is_refused_as_changed(tmp_path):
    # A procfs file says 0 bytes and holds more: exactly what a file still being written looks like.
    growing = tmp_path / "growing.jpg"
    os.symlink("/proc/self/status", growing)
    reason = load_file(str(growing), "header").reason
    assert reason == "changed while being read (0 bytes when opened, then grew); make sure nothing is writing to it"


def test_unreadable_folders_fail_the_pack_or_are_skipped_and_reported(public_tmp, tmp_path):
    src = locked_tree(public_tmp, ["locked", "cat/locked-sub"])
    outs = public_tmp / "outs"
    outs.mkdir()
    outs.chmod(0o777)
    # One pack and verify as root first, so that every module they import lazily is loaded before the
    # child drops to nobody, who cannot read the interpreter's files under /root.
    write(tmp_path / "warm" / "cat" / "a.jpg", jpeg_bytes(1))
    warm = CliRunner().invoke(main, ["pack", str(tmp_path / "warm"), "--to", "lmdb", "-o", str(tmp_path / "warm.lmdb")])
    assert warm.exit_code == 0, warm.stderr
    warm = CliRunner().invoke(main, ["verify", str(tmp_path / "warm.lmdb"), "--against", str(tmp_path / "warm")])
    assert warm.exit_code == 0, warm.output

    def pack_both():
        runner = CliRunner()
        failed = runner.invoke(main, ["pack", str(src), "--to", "lmdb", "-o", str(outs / "fail.lmdb")])
        skipped = runner.invoke(main, ["pack", str(src), "--to", "lmdb", "-o", str(outs / "skip.lmdb"),
                                       "--on-error", "skip"])
        verified = runner.invoke(main, ["verify", str(outs / "skip.lmdb"), "--against", str(src)])
        return [failed.exit_code, failed.stderr, skipped.exit_code, skipped.stderr, verified.exit_code,
                verified.output]

    fail_code, fail_err, skip_code, skip_err, verify_code, verify_out = as_unprivileged(
        pack_both, [src / "locked", src / "cat" / "locked-sub"])
    assert fail_code == 1, fail_err
    assert ("cat/locked-sub: cannot read folder (Permission denied); fix its permissions, or pass --on-error skip "
            "to leave it out") in fail_err
    assert not (outs / "fail.lmdb").exists()
    assert skip_code == 0, skip_err
    assert "skipped cat/locked-sub: cannot read folder (Permission denied)" in skip_err
    assert "skipped locked: cannot read folder (Permission denied)" in skip_err
    meta = read_metadata(str(outs / "skip.lmdb"))
    assert meta.count == 3 and meta.classes == ["cat", "dog", "locked"]
    assert [(s["path"], s["reason"]) for s in meta.skipped] == [
        ("cat/locked-sub", "cannot read folder (Permission denied)"),
        ("locked", "cannot read folder (Permission denied)")]
    # The folders it skipped are still unreadable: verify says so and checks the rest.
    assert verify_code == 0, verify_out
    assert "note: locked: skipped at pack time (cannot read folder (Permission denied)), and still unreadable" \
        in verify_out
    assert "ok: 3 records intact, identical to" in verify_out
