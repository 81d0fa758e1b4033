"""Per-process lazy handles: opened on first use, never carried across fork or pickle.

A reader stores plain data only (path, split, small metadata). Its handle is opened the
first time a process needs it and remembered with that process's pid; a handle whose pid
is not ours was inherited through fork and is closed and reopened, and pickling (spawn,
DDP) drops it. lmdb >= 2.0 refuses a second open of one file in a process, so handles
are shared per (pid, real path, file identity) and reference-counted.

The pid compared is kept by a fork hook, not asked of the kernel: a read asks for its
handle twice, and each os.getpid() is a system call, which a warm read of a small record
feels.

The identity (inode, size, mtime of the dataset's main file; see
_tables.file_identity) is part of the key because a dataset can be replaced at its path
(pack --force) while in use: a reader opened before keeps the old file's handle and reads
the old dataset consistently, and a reader opened after gets a handle of the new file.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
from typing import Any, Callable, Iterator

_lock = threading.Lock()
# (real path, identity) -> [pid, handle, refcount, closer]
_shared: dict[tuple, list] = {}
# A reader's __del__ can run inside the locked region below, whenever the garbage collector
# runs there (any allocation; closing an LMDB environment frees its transactions): its
# release would wait for the lock this thread holds. Such releases are queued and done
# once the lock is given back.
_local = threading.local()
_deferred: list[tuple[str, tuple]] = []
_pid = os.getpid()  # this process's: set again in each child os.fork() makes (_forked)


def _forked() -> None:
    """In a child os.fork() made: its own pid, and a lock of its own. Another thread of the
    parent may have held the lock (opening a file, or a reader's release run by the garbage
    collector) at the fork; that thread does not exist in the child, so the inherited lock
    would never be given back, and the child's first read (a DataLoader worker's) would wait
    for it forever."""
    global _pid, _lock, _local
    _pid = os.getpid()
    _lock, _local = threading.Lock(), threading.local()


if hasattr(os, "register_at_fork"):  # POSIX; without it there is no os.fork to follow either
    os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with _lock:
        _local.busy = True
        try:
            yield
        finally:
            _local.busy = False


def acquire(path: str, opener: Callable[[str], Any], closer: Callable[[Any], None], identity: tuple) -> Any:
    """This process's shared handle for the file with this identity at path, opened with
    opener(path) when needed (the caller checks the file opened is the one it meant)."""
    key = (os.path.realpath(path), identity)
    pid = _pid
    try:
        with _locked():
            _close_inherited(key[0], pid)
            entry = _shared.get(key)
            if entry is None:
                entry = [pid, opener(path), 0, closer]
                _shared[key] = entry
            entry[2] += 1
            return entry[1]
    finally:
        _release_deferred()


def _close_inherited(real: str, pid: int) -> None:
    """Close the handles of real path inherited through fork: the parent's handle must be
    closed in this process before the file can be opened again here (lmdb's rule)."""
    for key in [k for k, entry in _shared.items() if k[0] == real and entry[0] != pid]:
        entry = _shared.pop(key)
        _close_quietly(entry[3], entry[1])


def release(path: str, identity: tuple) -> None:
    if getattr(_local, "busy", False):  # a finalizer run inside the locked region (see _deferred)
        _deferred.append((path, identity))
        return
    key = (os.path.realpath(path), identity)
    try:
        with _locked():
            entry = _shared.get(key)
            if entry is None or entry[0] != _pid:
                return
            entry[2] -= 1
            if entry[2] <= 0:
                del _shared[key]
                _close_quietly(entry[3], entry[1])
    finally:
        _release_deferred()


def _release_deferred() -> None:
    while _deferred and not getattr(_local, "busy", False):
        release(*_deferred.pop())


@contextlib.contextmanager
def borrowed(path: str, opener: Callable[[str], Any], closer: Callable[[Any], None],
             identity: tuple) -> Iterator[Any]:
    """This process's shared handle for path for the length of a with block."""
    handle = acquire(path, opener, closer, identity)
    try:
        yield handle
    finally:
        release(path, identity)


def _close_quietly(closer: Callable[[Any], None], handle: Any) -> None:
    try:
        closer(handle)
    except Exception:  # an inherited handle may already be unusable; it is being discarded
        pass


class LazyHandle:
    """Mixin for readers: self.handle() opens per process; pickling drops the handle.

    Subclasses define _open() -> handle and _close(handle).
    """

    _handle: Any = None
    _handle_pid: int | None = None
    # Set when the interpreter begins to exit (see quiet_exit): a reader still held then (a
    # module-level Dataset) is left to the operating system to close, since module globals
    # (os, threading) may already be None when its __del__ runs, and a failing __del__ prints.
    # A class attribute: module globals are cleared at shutdown, classes' are not.
    exiting = False

    def handle(self) -> Any:
        if self._handle is None or self._handle_pid != _pid:
            self._handle = None  # never use, and never close, another process's handle here
            self._handle = self._open()
            self._handle_pid = _pid
        return self._handle

    @property
    def is_open(self) -> bool:
        return self._handle is not None and self._handle_pid == _pid

    def close(self) -> None:
        if self.is_open:
            self._close(self._handle)
        self._handle = None
        self._handle_pid = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_handle", None)
        state.pop("_handle_pid", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __del__(self):
        if self.exiting:
            return
        try:
            self.close()
        except Exception:
            pass

    def _open(self) -> Any:
        raise NotImplementedError

    def _close(self, handle: Any) -> None:
        raise NotImplementedError


@atexit.register
def quiet_exit() -> None:
    """Mark readers as exiting: atexit handlers run before module globals are cleared, and
    the descriptors and maps of handles still open are closed with the process."""
    LazyHandle.exiting = True
