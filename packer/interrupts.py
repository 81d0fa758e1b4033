"""Ctrl-C or SIGTERM during a pack or convert: stop within moments, leave nothing behind.

SIGTERM is how schedulers stop a job (SLURM at its time limit or on preemption, Kubernetes,
`timeout`, `docker stop`); by default it kills Python at once and leaves the staging path
(the next run to the same OUT removes it). While a pack writes (InterruptGuard), and for
the whole of a `packer` command (stop_signals_as_interrupts: an upload too), it takes
Ctrl-C's way out.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator

from .command_stops import exit_early

CLEANUP_GRACE_S = 5.0  # after a Ctrl-C, further ones are ignored this long (InterruptGuard)
STOP_REQUEST_EVERY = 64  # InterruptGuard.check() calls between looks at a stop request (stop_when)
OWNER_WATCH_S = 0.5  # how often a worker looks whether the process that owns it is still there (stop_when)
OWNER_GONE_EXIT = 70  # a worker's exit status when its owner died (EX_SOFTWARE: nothing to report to)

_stop_request = None  # in a worker process: the Event its pool's owner sets to stop it (stop_when)
_scopes = 0  # InterruptGuards and stop_signals_as_interrupts() open in the main thread
_guards: list["InterruptGuard"] = []  # the open guards, innermost last
_held: dict | None = None  # after hold_stops(): each stop signal's handler to put back when the hold ends
_held_for: str | None = None  # the OUT whose publishing started the hold
_late: list[int] = []  # stop signals that came while held


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


def stop_when(event, owner: int | None = None) -> None:
    """A worker process's initializer: every InterruptGuard in this process stops, as on
    Ctrl-C, once `event` (a multiprocessing Event) is set by the process that owns the pool,
    and that is how it stops: the worker ignores stop signals itself. With the owner's pid,
    the worker exits once the owner is gone (killed outright: nobody would ever set the
    event, and the worker would wait for work forever; what it wrote is a dead owner's
    staging, which the next pack to OUT removes).

    A signal sent to that process alone (`kill PID`, Kubernetes, `timeout`) reaches none of
    its workers; without the event they would run their work to the end before it could
    exit. One sent to the whole group (a terminal's Ctrl-C) reaches them all, and a worker
    waiting for work would die of it with a traceback; the owner sets the event on either,
    and shuts its pool down. The owner starts its workers with the stop signals blocked
    (they inherit the mask), so that one landing while they start is not raised either."""
    global _stop_request
    _stop_request = event
    ignore_stop_signals()
    if owner is not None:
        threading.Thread(target=exit_without, args=(owner,), name="packer-owner-watch", daemon=True).start()


def exit_without(owner: int) -> None:
    """Exit this process once it is no longer owner's child (owner died: it was re-parented)."""
    while os.getppid() == owner:
        time.sleep(OWNER_WATCH_S)
    os._exit(OWNER_GONE_EXIT)


def ignore_stop_signals() -> None:
    """In a worker process its owner stops: SIGINT and SIGTERM ignored, then unblocked (the
    owner starts its workers with them blocked, so none lands before this)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_as_interrupts() -> Iterator[None]:
    """SIGTERM raises Stopped, a KeyboardInterrupt, in the main thread while this is active
    (where SIGTERM still has its default action): whatever cleans up after Ctrl-C then
    cleans up after it too. The `packer` command runs inside one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = None
    _open_scope()
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, exit_early):
            previous = signal.signal(signal.SIGTERM, raise_stopped)
        yield
    finally:
        if previous is not None:
            _set_handler(signal.SIGTERM, previous)
        _close_scope()


def hold_stops(out: str) -> None:
    """OUT is about to be published: from here until the last open guard of OUT closes (a
    pack's, or a pack in parts' around its merge), a stop signal is noted, not raised, and
    the write runs to its end. Past this point nothing can be undone, and a signal would
    only cut its tidying short (an old dataset half removed beside OUT, a parts' staging
    folder) and report "nothing was written" over a complete OUT. What comes after, such
    as an upload of the local pack, takes signals again."""
    global _held, _held_for
    if _held is None and _scopes > 0 and threading.current_thread() is threading.main_thread():
        ours = [signum for signum in STOP_SIGNALS if taken_over(signum, signal.getsignal(signum))]
        _held = {signum: signal.signal(signum, _note_late) for signum in ours}  # a program's own stays
        _held_for = os.path.abspath(out)


def late_stops() -> list[int]:
    """The stop signals that came while held (hold_stops), forgotten once asked for."""
    found = list(_late)
    _late.clear()
    return found


def check_pending() -> None:
    """The innermost open guard's check(): before publishing, a Ctrl-C dropped in the
    writer's last steps (finish()) still stops the write."""
    if _guards:
        _guards[-1].check()


def _note_late(signum, frame) -> None:
    _late.append(int(signum))


def _set_handler(signum: int, handler) -> None:
    """signal.signal(signum, handler), or while held, the handler to put back afterwards."""
    if _held is not None and signum in _held:
        _held[signum] = handler
    else:
        signal.signal(signum, handler)


def _open_scope() -> None:
    global _scopes
    _scopes += 1


def _close_scope() -> None:
    global _scopes
    _scopes -= 1
    if _held is not None and (_scopes == 0 or not any(guard.out is not None and os.path.abspath(guard.out) == _held_for
                                                      for guard in _guards)):
        _end_hold()


def _end_hold() -> None:
    global _held, _held_for
    held, _held, _held_for = _held, None, None
    for signum, handler in held.items():
        signal.signal(signum, handler)


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
        if threading.current_thread() is not threading.main_thread():
            return self
        _open_scope()
        _guards.append(self)
        try:
            for signum in STOP_SIGNALS:
                if taken_over(signum, signal.getsignal(signum)):
                    self._previous[signum] = signal.signal(signum, self._interrupt)
        except BaseException:  # a signal between two take-overs: leave as it was found
            self._leave()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self in _guards:
            self._leave()
        if self.out is not None and isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(self.out, self.signum) from None

    def _leave(self) -> None:
        """Put back the handlers taken over, passing a stop already under way to the guard
        they belong to (one write inside another: a merge inside a pack in parts)."""
        for signum, handler in self._previous.items():
            outer = outer_guard(handler)
            if outer is not None and self.pending and not outer.pending:
                outer.pending, outer._first, outer.signum = True, self._first, self.signum
            _set_handler(signum, handler)
        self._previous = {}
        _guards.remove(self)
        _close_scope()

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


def taken_over(signum: int, handler) -> bool:
    """Whether a guard takes signum over from handler: one of TAKEN_OVER's, or another
    guard's (a write inside another); never a handler the program set."""
    return any(handler is ours for ours in TAKEN_OVER[signum]) or outer_guard(handler) is not None


def outer_guard(handler) -> "InterruptGuard | None":
    """The guard whose handler this is, if it is one: a guard inside another takes over from it."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, InterruptGuard) and getattr(handler, "__func__", None) is \
        InterruptGuard._interrupt else None
