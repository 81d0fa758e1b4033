"""packer.formats._handle: shared per-process handles, and finalizers that run while it holds its lock."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from conftest import jpeg_bytes, write
from packer import pack
from packer.formats import _handle


def test_a_release_from_a_finalizer_inside_acquire_does_not_deadlock(tmp_path):
    """The garbage collector can run a reader's __del__ (and so release()) at any allocation,
    including inside acquire's locked region: that release must not wait for the lock its
    own thread holds."""
    closed = []
    other, mine = str(tmp_path / "other"), str(tmp_path / "mine")
    _handle.acquire(other, lambda path: "other-handle", closed.append, ("id",))

    def opener(path):  # what a finalizer does when the collector runs here
        _handle.release(other, ("id",))
        return "my-handle"

    result = []
    worker = threading.Thread(target=lambda: result.append(_handle.acquire(mine, opener, closed.append, ("id",))),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "acquire deadlocked on a release made inside it"
    assert result == ["my-handle"] and closed == ["other-handle"]  # the deferred release was done
    _handle.release(mine, ("id",))
    assert closed == ["other-handle", "my-handle"]


def test_the_pid_handles_are_kept_under_follows_a_fork():
    """Handles are checked against a pid kept by a fork hook, not asked of the kernel at each
    read: a child os.fork() makes must see its own pid there, or it would use its parent's
    handles (an LMDB environment, an h5py file) as its own."""
    parent = os.getpid()
    assert _handle._pid == parent
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _handle._pid == os.getpid() != parent else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _handle._pid == parent


@pytest.mark.parametrize("module, lock", [("packer.formats._handle", "_lock"), ("packer.remote.source", "_state_lock")])
def test_a_lock_another_thread_holds_at_a_fork_is_free_in_the_child(module, lock):
    """A DataLoader worker forked while another thread of the trainer opens or releases a
    handle (the garbage collector runs a reader's release on any thread) must not inherit a
    lock that no thread of its own will ever give back: its first read would wait forever."""
    import importlib

    owner = importlib.import_module(module)
    held, fork_done = threading.Event(), threading.Event()

    def hold() -> None:
        with getattr(owner, lock):
            held.set()
            fork_done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if getattr(owner, lock).acquire(timeout=5) else 1)
    fork_done.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child found {module}.{lock} held by a thread it does not have"


# A training script's normal shape: Datasets held at module level (so a spawned or forkserver
# worker, which imports the script again, makes its own), read in the main process and in a
# DataLoader worker, and still held when the interpreter exits. One worker reads them all (it is
# given them pickled, as a DataLoader gives its dataset), so each start method starts one.
QUIET_EXIT_SCRIPT = r"""
import collections
import sys
import io  # kept alive to the end of shutdown (sys.stdout's), so cleared after packer's module globals
from torch.utils.data import DataLoader, IterableDataset
import readers

root, context = sys.argv[1], sys.argv[2]
datasets = [readers.LMDBDataset(f"{root}/d.lmdb", decode="raw"), readers.HDF5Dataset(f"{root}/d.h5", decode="raw"),
            readers.WDSMapDataset(f"{root}/d.wds", decode="raw"), readers.WDSDataset(f"{root}/d.wds", decode="raw"),
            readers.FolderDataset(f"{root}/src", decode="raw")]
io.held_datasets = datasets  # reachable until packer's globals are None, as from any module that outlives them


class Every(IterableDataset):  # the number of the dataset each sample came from, all read in the worker
    def __init__(self, datasets):
        self.datasets = datasets

    def __iter__(self):
        for number, ds in enumerate(self.datasets):
            samples = ds if isinstance(ds, readers.WDSDataset) else (ds[i] for i in range(len(ds)))
            for _ in samples:
                yield number


if __name__ == "__main__":
    for ds in datasets:
        if not isinstance(ds, readers.WDSDataset):
            ds[0]  # opened in this process, and left open
    loader = DataLoader(Every(datasets), batch_size=None, num_workers=1, multiprocessing_context=context)
    assert collections.Counter(int(n) for n in loader) == {number: 6 for number in range(len(datasets))}
    print("read")
"""


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """6 images packed in every format, and their folder."""
    root = tmp_path_factory.mktemp("held")
    for i in range(6):
        write(root / "src" / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(i, size=(16, 16)))
    for fmt, ext in (("lmdb", ".lmdb"), ("hdf5", ".h5"), ("wds", ".wds")):
        pack(str(root / "src"), fmt, str(root / f"d{ext}"), workers=1, progress=False)
    return root


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_datasets_held_at_exit_print_nothing(packed, tmp_path, context):
    """No reader or Dataset of any format prints at interpreter shutdown ('Exception ignored
    in ... __del__', a warning), in the main process or a worker, under any start method."""
    script = tmp_path / "train.py"
    script.write_text(QUIET_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(packed), context], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "read\n", "")
