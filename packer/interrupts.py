"""Ctrl-C during a pack or convert: stop within moments, leave nothing behind, exit 130."""
from __future__ import annotations

import signal
import threading
import time

CLEANUP_GRACE_S = 5.0  # after a Ctrl-C, further ones are ignored this long (InterruptGuard)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a pack or convert; OUT was left untouched."""

    def __init__(self, out: str):
        super().__init__(f"interrupted; nothing was written at {out}")
        self.out = out


class InterruptGuard:
    """Makes Ctrl-C stop a pack or convert that writes to out, even a Ctrl-C that Python drops.

    Python raises KeyboardInterrupt wherever the main thread is; inside a finalizer or a
    weakref callback (h5py runs those while it writes) it is printed and dropped, and the
    pack would run on and publish. While the guard is active (main thread only, over
    Python's default handler), SIGINT also sets `pending`, which the writing loop checks at
    every record and before the dataset is finished; the interrupt leaves as Interrupted(out).
    A second Ctrl-C within CLEANUP_GRACE_S of the first is ignored, so that it cannot cut
    short the removal of the staging path; a later one raises again.
    """

    def __init__(self, out: str | None = None):
        self.out, self.pending, self._previous = out, False, None
        self._first = 0.0

    def __enter__(self) -> "InterruptGuard":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self.out is not None and isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(self.out) from None

    def _interrupt(self, signum, frame) -> None:
        if self.pending and time.monotonic() - self._first < CLEANUP_GRACE_S:
            return
        self.pending, self._first = True, time.monotonic()
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise the KeyboardInterrupt of a Ctrl-C that was dropped on its way."""
        if self.pending:
            raise KeyboardInterrupt
