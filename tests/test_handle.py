"""packer.formats._handle: shared per-process handles, and finalizers that run while it holds its lock."""
from __future__ import annotations

import threading

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
