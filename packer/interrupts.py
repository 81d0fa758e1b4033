"""Ctrl-C or SIGTERM during a pack or convert: stop within moments, leave nothing behind.

SIGTERM is how schedulers stop a job (SLURM at its time limit or on preemption, Kubernetes,
`timeout`, `docker stop`); by default it kills Python at once and leaves the staging path
(the next run to the same OUT removes it). While a pack writes (InterruptGuard), and for
the whole of a `packer` command (stop_signals_as_interrupts: an upload too), it takes
Ctrl-C's way out.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Iterator

CLEANUP_GRACE_S = 5.0  # after a Ctrl-C, further ones are ignored this long (InterruptGuard)
STOP_REQUEST_EVERY = 64  # InterruptGuard.check() calls between looks at a stop request (stop_when)

_stop_request = None  # in a worker process: the Event its pool's owner sets to stop it (stop_when)


def how_stopped(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


class Stopped(KeyboardInterrupt):
    """SIGTERM taken as Ctrl-C (stop_signals_as_interrupts); `signum` says which signal."""

    def __init__(self, signum: int):
        super().__init__(how_stopped(signum))
        self.signum = int(signum)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: `signum`) stopped a pack or convert; OUT was left untouched."""

    def __init__(self, out: str, signum: int = signal.SIGINT):
        super().__init__(f"{how_stopped(signum)}; nothing was written at {out}")
        self.out, self.signum = out, int(signum)


def raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


def stop_when(event) -> None:
    """A worker process's initializer: every InterruptGuard in this process also stops, as on
    Ctrl-C, once `event` (a multiprocessing Event) is set by the process that owns the pool.

    A signal sent to that process alone (`kill PID`, Kubernetes, `timeout`) reaches none of
    its workers; without this they would run their work to the end before it could exit."""
    global _stop_request
    _stop_request = event


@contextlib.contextmanager
def stop_signals_as_interrupts() -> Iterator[None]:
    """SIGTERM raises Stopped, a KeyboardInterrupt, in the main thread while this is active
    (where SIGTERM still has its default action): whatever cleans up after Ctrl-C then
    cleans up after it too. The `packer` command runs inside one."""
    previous = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# The handlers the guard takes a signal over from: Python's own for SIGINT; the default
# action (die), or stop_signals_as_interrupts', for SIGTERM. One the program set is left alone.
TAKEN_OVER = {signal.SIGINT: (signal.default_int_handler,), signal.SIGTERM: (signal.SIG_DFL, raise_stopped)}
STOP_SIGNALS = tuple(TAKEN_OVER)  # what stops a write; packer.engine's pool workers ignore them


class InterruptGuard:
    """Makes Ctrl-C or SIGTERM stop a pack or convert that writes to out, even when Python drops it.

    Python raises KeyboardInterrupt wherever the main thread is; inside a finalizer or a
    weakref callback (h5py runs those while it writes) it is printed and dropped, and the
    pack would run on and publish. While the guard is active (main thread only, over the
    handlers in TAKEN_OVER), SIGINT and SIGTERM raise KeyboardInterrupt and set `pending`,
    which the writing loop checks at every record and before the dataset is finished; the
    interrupt leaves as Interrupted(out, signum). A second signal within CLEANUP_GRACE_S of
    the first is ignored, so that it cannot cut short the removal of the staging path; a
    later one raises again.
    """

    def __init__(self, out: str | None = None):
        self.out, self.pending, self._previous = out, False, {}
        self._first, self.signum, self._checks = 0.0, signal.SIGINT, 0

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            for signum, handlers in TAKEN_OVER.items():
                if any(signal.getsignal(signum) is handler for handler in handlers):
                    self._previous[signum] = signal.signal(signum, self._interrupt)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self.out is not None and isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(self.out, self.signum) from None

    def _interrupt(self, signum, frame) -> None:
        if self.pending and time.monotonic() - self._first < CLEANUP_GRACE_S:
            return
        self.pending, self._first, self.signum = True, time.monotonic(), signum
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise the KeyboardInterrupt of a Ctrl-C that was dropped on its way, or of a stop
        requested by the process that owns this worker (stop_when; looked at every
        STOP_REQUEST_EVERY calls, as it costs a lock)."""
        if self.pending:
            raise KeyboardInterrupt
        if _stop_request is not None:
            self._checks += 1
            if self._checks % STOP_REQUEST_EVERY == 0 and _stop_request.is_set():
                self.pending, self._first = True, time.monotonic()
                raise KeyboardInterrupt
