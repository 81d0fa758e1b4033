"""Ctrl-C and SIGTERM stop pack and convert within moments: exit 130 / 143, no staging left, no worker left.

Each case starts the real CLI in its own session (process group) and, once its staging
path exists, sends SIGINT to the whole group, as a terminal's Ctrl-C does.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from packer.interrupts import InterruptGuard, Interrupted
from packer.output import tidy
from packer.pack import Loaded, write_listings
from packer.records import PathTable
from packer.scan import SplitListing

from conftest import jpeg_bytes

ROOT = Path(__file__).resolve().parents[1]
FILES = 20_000  # hard links to one small JPEG: quick to make, long enough to pack to be interrupted
STOP_WITHIN_S = 5


def linked_tree(src: Path, files: int) -> Path:
    """SRC/classNN/NNNN.jpg: `files` hard links to a small JPEG, 1,000 a class, a copy of the
    JPEG per 20 classes (ext4 allows 65,000 links to one file)."""
    for c in range(files // 1000):
        original = src.parent / f"original{c // 20}.jpg"
        if not original.exists():
            original.write_bytes(jpeg_bytes(7, size=(64, 64)))
        folder = src / f"class{c:02d}"
        folder.mkdir(parents=True)
        for i in range(1000):
            os.link(original, folder / f"{i:04d}.jpg")
    return src


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory) -> Path:
    return linked_tree(tmp_path_factory.mktemp("interrupt") / "src", FILES)


@pytest.fixture(scope="module")
def parts_tree(tmp_path_factory) -> Path:
    """Four times big_tree: its two parts take ~10 s here when left to finish, twice the
    STOP_WITHIN_S a stopped or orphaned part is given."""
    return linked_tree(tmp_path_factory.mktemp("interrupt-parts") / "src", 4 * FILES)


def processes_in_group(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:  # fields after the name: state, ppid, pgrp
            found.append(int(entry))
    return found


def staging(out: Path) -> list[Path]:
    return sorted(out.parent.glob(out.name + ".partial-*"))


def interrupt(args: list, out: Path, workers: int, signum=signal.SIGINT,
              group: bool = True) -> tuple[int, float, str, list[int]]:
    """Run the CLI, send it signum once its staging exists and its `workers` worker processes
    run: to its whole process group (a terminal's Ctrl-C, SLURM's SIGTERM to a job's
    processes), or to the command's own process alone (`kill PID`, `timeout`, Kubernetes).

    Returns its exit code, the seconds it took to stop, its stderr, and the processes of its
    group still there after it exited (its workers, had it left any).
    """
    proc = subprocess.Popen([sys.executable, "-m", "packer.cli", *map(str, args), "-o", str(out)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not staging(out) or len(processes_in_group(proc.pid)) < 1 + workers:
            assert proc.poll() is None, f"finished before it could be interrupted: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no staging path (or no workers) appeared"
            time.sleep(0.005)
        time.sleep(0.05)  # into the reading and writing
        (os.killpg if group else os.kill)(proc.pid, signum)
        sent = time.monotonic()
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after {signal.Signals(signum).name}: {args}")
        seconds = time.monotonic() - sent
        return proc.returncode, seconds, stderr, processes_in_group(proc.pid)
    finally:
        if proc.poll() is None or processes_in_group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def assert_stopped_cleanly(args: list, out: Path, workers: int = 0, signum=signal.SIGINT, group: bool = True) -> None:
    code, seconds, stderr, left = interrupt(args, out, workers, signum, group)
    state = f"exit {code} after {seconds:.1f} s, processes left {left}, stderr:\n{stderr}"
    assert code == 128 + signum, state
    assert seconds < STOP_WITHIN_S, state
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    assert stderr.strip().endswith(f"{how}; nothing was written at {out}"), state
    assert not out.exists() and staging(out) == [], state
    assert left == [], state


def test_ctrl_c_stops_a_pack_that_decodes_in_worker_processes(big_tree, tmp_path):
    assert_stopped_cleanly(["pack", big_tree, "--to", "lmdb", "--check", "full", "--workers", "2"],
                           tmp_path / "out.lmdb", workers=2)


def test_ctrl_c_stops_an_hdf5_pack(big_tree, tmp_path):
    assert_stopped_cleanly(["pack", big_tree, "--to", "hdf5", "--workers", "2"], tmp_path / "out.h5")  # threads


def test_ctrl_c_stops_a_convert(big_tree, tmp_path):
    packed = tmp_path / "packed.lmdb"
    subprocess.run([sys.executable, "-m", "packer.cli", "pack", str(big_tree), "--to", "lmdb", "-o", str(packed)],
                   cwd=ROOT, check=True, capture_output=True)
    assert_stopped_cleanly(["convert", packed, "--to", "hdf5", "--workers", "2"], tmp_path / "converted.h5",
                           workers=2)


@pytest.mark.parametrize("group", [False, True], ids=["to-the-command", "to-its-group"])
def test_sigterm_stops_a_pack_with_worker_processes_like_ctrl_c(big_tree, tmp_path, group):
    # A scheduler's stop: SLURM signals every process of the job, `kill`/Kubernetes the command.
    assert_stopped_cleanly(["pack", big_tree, "--to", "lmdb", "--check", "full", "--workers", "2"],
                           tmp_path / "out.lmdb", workers=2, signum=signal.SIGTERM, group=group)


def test_sigterm_stops_an_hdf5_pack_like_ctrl_c(big_tree, tmp_path):
    assert_stopped_cleanly(["pack", big_tree, "--to", "hdf5", "--workers", "2"], tmp_path / "out.h5",
                           signum=signal.SIGTERM, group=False)


def test_sigterm_to_a_pack_in_parts_stops_its_parts_instead_of_waiting_for_them(parts_tree, tmp_path):
    # The signal reaches the command alone, so only the command can tell its part processes to stop.
    out = tmp_path / "out.lmdb"
    args = ["pack", parts_tree, "--to", "lmdb", "--parts", "2", "--check", "full", "--workers", "1"]
    code, seconds, stderr, _ = interrupt(args, out, workers=2, signum=signal.SIGTERM, group=False)
    state = f"exit {code} after {seconds:.1f} s, stderr:\n{stderr}"
    assert code == 143 and seconds < STOP_WITHIN_S, state
    assert stderr.strip().endswith(f"stopped by SIGTERM; nothing was written at {out}"), state
    assert not out.exists() and staging(out) == [], state


def test_a_pack_in_parts_killed_outright_leaves_no_part_process_behind(parts_tree, tmp_path):
    """SIGKILL reaches the command alone: nothing tells its part processes, which ignore stop
    signals and would otherwise wait for work forever; each sees its owner gone and exits."""
    out = tmp_path / "out.lmdb"
    proc = subprocess.Popen([sys.executable, "-m", "packer.cli", "pack", str(parts_tree), "--to", "lmdb", "--parts",
                             "2", "--check", "full", "--workers", "1", "-o", str(out)], cwd=ROOT,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not staging(out) or len(processes_in_group(proc.pid)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "no staging path (or no parts) appeared"
            time.sleep(0.005)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + STOP_WITHIN_S
        while processes_in_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_in_group(proc.pid) == [], "part processes outlived their pack"
    finally:
        if processes_in_group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    left = [str(path) for path in staging(out)]
    assert left and tidy(str(out)).removed == left  # what the next pack to OUT does first
    assert staging(out) == []


class InterruptsWhenCollected:
    def __del__(self):
        # The SIGINT handler runs right here; Python prints its KeyboardInterrupt and drops it,
        # as it does when a Ctrl-C lands in a finalizer or weakref callback (h5py runs those).
        signal.raise_signal(signal.SIGINT)


class ListWriter:
    """Only records what it is given (the formats' writers are tested elsewhere)."""

    def __init__(self):
        self.added = []

    def begin_split(self, name, expected_count=None):
        pass

    def add(self, data, label, relpath, crc):
        self.added.append(relpath)

    def end_split(self, labels, paths, order=None):
        pass


def test_a_ctrl_c_dropped_inside_a_finalizer_still_stops_the_writing(monkeypatch):
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)  # where Python sends what it cannot raise
    paths = [f"c/{i}.jpg" for i in range(100)]
    listings = {"all": SplitListing(PathTable.from_strings(paths), np.zeros(100, np.int32), True)}

    def loaded():
        for i in range(100):
            if i == 10:
                InterruptsWhenCollected()  # collected at once
            yield Loaded(b"x", i, None)

    writer = ListWriter()
    with pytest.raises(Interrupted, match="interrupted; nothing was written at OUT"):
        with InterruptGuard("OUT") as guard:
            write_listings(writer, listings, 1, loaded(), "fail", False, guard=guard)
    assert writer.added == paths[:10]
    assert [type(d.exc_value) for d in dropped] == [KeyboardInterrupt]  # it was dropped where it was raised


def test_a_second_ctrl_c_does_not_cut_the_cleanup_short():
    cleaned = False
    with pytest.raises(Interrupted):
        with InterruptGuard("OUT"):
            try:
                signal.raise_signal(signal.SIGINT)
            finally:  # the cleanup (pool teardown, staging removal), and an impatient second Ctrl-C
                signal.raise_signal(signal.SIGINT)
                cleaned = True
    assert cleaned
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on the way out


def test_a_sigterm_during_the_cleanup_of_a_ctrl_c_is_ignored_too_and_both_handlers_come_back():
    cleaned = False
    with pytest.raises(Interrupted, match="interrupted; nothing was written at OUT") as stopped:
        with InterruptGuard("OUT"):
            try:
                signal.raise_signal(signal.SIGINT)
            finally:  # a scheduler's SIGTERM arriving while the staging path is removed
                signal.raise_signal(signal.SIGTERM)
                cleaned = True
    assert cleaned and stopped.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_the_program_set_for_sigterm_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with InterruptGuard("OUT"):
            signal.raise_signal(signal.SIGTERM)  # the program's handler runs; the pack goes on
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


# A Ctrl-C that lands in Pool.apply_async after it registered a job and before it queued it.
INTERRUPTED_SUBMIT = """
import signal
import multiprocessing.pool
from packer import engine

register = multiprocessing.pool.ApplyResult.__init__
made = []

def register_then_interrupt(self, *args, **kwargs):
    register(self, *args, **kwargs)
    made.append(self)
    if len(made) == 3:
        signal.raise_signal(signal.SIGINT)

multiprocessing.pool.ApplyResult.__init__ = register_then_interrupt
try:
    for _ in engine.load_in_processes(list(range(1000)), abs, 2, chunk=10):
        pass
except KeyboardInterrupt:
    print("stopped after", len(made), "jobs")
"""


def test_an_interrupt_inside_a_job_submission_still_lets_the_pool_stop():
    # Without the signals held off there, the registered job is never queued and
    # Pool.join() waits for it forever.
    try:
        done = subprocess.run([sys.executable, "-c", INTERRUPTED_SUBMIT], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the pool never stopped after an interrupt inside apply_async")
    assert done.stdout.strip() == "stopped after 3 jobs", done.stderr


def test_the_command_takes_sigterm_as_ctrl_c_and_the_guard_takes_it_over_while_writing():
    from packer.interrupts import Stopped, raise_stopped, stop_signals_as_interrupts

    with stop_signals_as_interrupts():
        assert signal.getsignal(signal.SIGTERM) is raise_stopped
        with pytest.raises(Stopped, match="stopped by SIGTERM") as outside:  # e.g. during an upload
            signal.raise_signal(signal.SIGTERM)
        assert outside.value.signum == signal.SIGTERM
        with pytest.raises(Interrupted, match="stopped by SIGTERM; nothing was written at OUT") as writing:
            with InterruptGuard("OUT") as guard:
                signal.raise_signal(signal.SIGTERM)
        assert writing.value.signum == signal.SIGTERM and guard.pending
        assert signal.getsignal(signal.SIGTERM) is raise_stopped  # the guard gave it back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_worker_stops_at_its_next_records_once_its_pools_owner_asks(monkeypatch):
    import multiprocessing

    from packer import interrupts

    stop = multiprocessing.get_context("spawn").Event()
    monkeypatch.setattr(interrupts, "_stop_request", None)
    saved = {signum: signal.getsignal(signum) for signum in interrupts.STOP_SIGNALS}
    try:
        interrupts.stop_when(stop)
        # The worker ignores stop signals itself: a group's Ctrl-C would kill an idle one
        # with a traceback. Its owner stops it through the event.
        assert all(signal.getsignal(signum) is signal.SIG_IGN for signum in interrupts.STOP_SIGNALS)
        with pytest.raises(Interrupted, match="interrupted; nothing was written at OUT"):
            with InterruptGuard("OUT") as guard:
                for _ in range(10 * interrupts.STOP_REQUEST_EVERY):
                    guard.check()  # not asked yet: the records go on
                stop.set()
                for checked in range(interrupts.STOP_REQUEST_EVERY + 1):
                    guard.check()
        assert checked < interrupts.STOP_REQUEST_EVERY
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


# The real CLI, with one of packer's own steps wrapped to send this process a signal at a
# chosen moment: deterministic where a signal from outside would have to hit a window of
# milliseconds. argv: module, function, signal name, then the packer command's arguments.
SIGNAL_AT = """
import functools, importlib, os, signal, sys
module, name, signame = sys.argv[1:4]
target = importlib.import_module(module)
original = getattr(target, name)
sent = []

@functools.wraps(original)
def signal_first(*args, **kwargs):
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), getattr(signal, signame))
    return original(*args, **kwargs)

setattr(target, name, signal_first)
from packer.cli import main
sys.argv = ["packer", *sys.argv[4:]]
main()
"""


def packer_with_signal_at(where: str, signame: str, *args) -> subprocess.CompletedProcess:
    module, name = where.rsplit(".", 1)
    return subprocess.run([sys.executable, "-c", SIGNAL_AT, module, name, signame, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def small_tree(root: Path, files: int = 40) -> Path:
    for i in range(files):
        path = root / f"c{i % 2}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg_bytes(seed=i))
    return root


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_while_force_removes_the_old_dataset_lets_it_finish(tmp_path, signame):
    """Past the swap nothing can be undone: the old dataset's removal runs to its end, the
    command succeeds, and says the signal came too late to stop it."""
    src, out = small_tree(tmp_path / "src"), tmp_path / "out.wds"
    subprocess.run([sys.executable, "-m", "packer", "pack", str(src), "--to", "wds", "-o", str(out)], cwd=ROOT,
                   check=True, capture_output=True)
    done = packer_with_signal_at("packer.output.remove_path", signame, "pack", src, "--to", "wds", "-o", out,
                                 "--force", "--shuffle-seed", "3")
    assert done.returncode == 0, done.stderr
    assert "after the dataset was published: it is complete" in done.stderr
    assert "nothing was written" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.wds", "src"]  # no half-removed old one beside it
    verified = subprocess.run([sys.executable, "-m", "packer", "verify", str(out), "--against", str(src)], cwd=ROOT,
                              capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_signal_after_the_merge_published_lets_the_parts_folder_go_and_succeeds(tmp_path):
    src, out = small_tree(tmp_path / "src"), tmp_path / "out.lmdb"
    done = packer_with_signal_at("packer.parts.remove_folder", "SIGTERM", "pack", src, "--to", "lmdb", "-o", out,
                                 "--parts", "2")
    assert done.returncode == 0, done.stderr
    assert "stopped by SIGTERM after the dataset was published" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.lmdb", "src"]  # the parts' folder is gone


def test_sigterm_during_the_merge_of_parts_says_sigterm(tmp_path):
    """The merge's guard sits inside the pack in parts' guard: it takes the signal over from
    it, so the stop is reported as the signal it was (exit 143, not 130)."""
    src, out = small_tree(tmp_path / "src"), tmp_path / "out.hdf5"
    done = packer_with_signal_at("packer.merge.write_listings", "SIGTERM", "pack", src, "--to", "hdf5", "-o", out,
                                 "--parts", "2")
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert f"stopped by SIGTERM; nothing was written at {out}" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_guard_inside_another_takes_over_and_hands_a_stop_back():
    with pytest.raises(Interrupted, match="stopped by SIGTERM; nothing was written at INNER") as stopped:
        with InterruptGuard("OUTER") as outer:
            with InterruptGuard("INNER") as inner:
                assert signal.getsignal(signal.SIGTERM) == inner._interrupt
                signal.raise_signal(signal.SIGTERM)
    assert stopped.value.signum == signal.SIGTERM and inner.pending and outer.pending
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is \
        signal.default_int_handler


def test_a_stop_dropped_while_the_writer_finished_is_caught_before_publishing(tmp_path):
    from packer.output import staged

    out = tmp_path / "out.bin"
    with pytest.raises(Interrupted, match="nothing was written"):
        with InterruptGuard(str(out)) as guard:
            with staged(str(out), force=False, directory=False) as stage:
                Path(stage).write_bytes(b"done")
                guard.pending = True  # a KeyboardInterrupt h5py printed and dropped in finish()
    assert list(tmp_path.iterdir()) == []


def test_held_stops_are_noted_and_the_handlers_come_back():
    from packer import interrupts

    with InterruptGuard("OUT"):
        interrupts.hold_stops("OUT")
        signal.raise_signal(signal.SIGTERM)  # noted, not raised
        signal.raise_signal(signal.SIGINT)
    assert interrupts.late_stops() == [signal.SIGTERM, signal.SIGINT] and interrupts.late_stops() == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is \
        signal.default_int_handler
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:  # a program's own handler is not held
        with InterruptGuard("OUT"):
            interrupts.hold_stops("OUT")
            signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM] and interrupts.late_stops() == []
    finally:
        signal.signal(signal.SIGTERM, previous)


DEFERRED = """
import os, signal, sys, threading, time
from packer import engine
calls = []
signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("inside" if inside else "after"))
threading.Thread(target=time.sleep, args=(10,), daemon=True).start()  # a thread that does not block SIGTERM
inside = True
with getattr(engine, sys.argv[1])():
    os.kill(os.getpid(), signal.SIGTERM)  # to the process: the kernel may hand it to the other thread
    time.sleep(0.3)  # a call that checks for signals, as the locks of apply_async's queue do
    inside = False
time.sleep(0.1)
print(",".join(calls))
"""


def test_a_stop_signal_sent_to_the_process_waits_for_the_end_of_a_pool_submission():
    # pool.apply_async registers its job before queueing it; a SIGTERM's handler run between
    # the two left a job that never runs, and the pack's Pool.join() waited for it forever.
    # Blocking the signal in the main thread does not hold the handler off while another
    # thread (tqdm's monitor, a reader) takes the signal for the process.
    proc = subprocess.run([sys.executable, "-c", DEFERRED, "stop_signals_deferred"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "after"
