"""The retry policy for remote reads and writes: transient errors again, with backoff, all
within one deadline.

A transient error (the server unreachable, slow, failing with 5xx or throttling; see
packer.remote.errors.is_transient) is tried again after a wait that starts at FIRST_WAIT
seconds and doubles up to MAX_WAIT, each wait jittered so that many workers that failed
together do not retry together. With the defaults a call is tried RETRIES times over about
eight seconds of waiting: long enough for a restarted server to come back, short enough
that a wrong endpoint is reported promptly. Anything else (missing object or bucket,
refused credentials, bad arguments) is reported at once: trying again cannot help.

Socket timeouts bound one read of a socket, not a request: a server that accepts and never
answers costs a read timeout per attempt, and one that sends a byte a second never trips it.
So every operation (one request and its retries) also has a deadline, DEADLINE seconds by
default (storage_options {"deadline": SECONDS}, the CLI's --deadline): each attempt is given
the time left, and fsspec's async backends (s3, gs, http(s), ...) cancel a request that
outlives it (bounded()); no attempt starts, and no wait is slept, past it. An upload or a
copy gets a second more per MIN_RATE bytes of its object, so a large file on a slow link
is not cut off while it moves.
"""
from __future__ import annotations

import contextlib
import numbers
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from ..errors import PackError
from .errors import TIMEOUT, RemoteError, cause, classify, describe, failure, is_transient

RETRIES = 6
FIRST_WAIT = 0.25
FACTOR = 2.0
MAX_WAIT = 8.0
JITTER = 0.25  # each wait is scaled by a random factor in [1 - JITTER, 1 + JITTER]
# Seconds for one operation, its attempts and waits included: under 2 minutes for a dead or
# silent server, and room for the 60 s socket read timeout plus a retry on a slow one.
DEADLINE = 90.0
MIN_RATE = 1 << 20  # bytes/s an upload or a server-side copy is allowed at the least

T = TypeVar("T")
# The end (time.monotonic()) and length of the whole operation under way in this process
# (within()), or None: each request's deadline is cut to what is left of it.
_whole: tuple[float, float] | None = None


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Every remote request made inside, its retries included, ends by `seconds` from now
    in all: a command of many requests (packer info) is bounded as a whole, not each of its
    requests by the deadline. An inner within() never extends an outer one."""
    global _whole
    outer = _whole
    end = time.monotonic() + seconds
    if outer is None or end < outer[0]:
        _whole = (end, seconds)
    try:
        yield
    finally:
        _whole = outer


def time_left(deadline: float) -> tuple[float, bool]:
    """(seconds this request may take: its deadline or what the whole operation has left,
    whichever is less; whether the whole operation's end is the one that binds)."""
    if _whole is None:
        return deadline, False
    left = _whole[0] - time.monotonic()
    return (left, True) if left < deadline else (deadline, False)


@dataclass(frozen=True)
class Backoff:
    """How many attempts, and the waits between them."""

    attempts: int = RETRIES
    first: float = FIRST_WAIT
    factor: float = FACTOR
    cap: float = MAX_WAIT

    def waits(self) -> Iterator[float]:
        """The attempts - 1 waits, jittered."""
        wait = self.first
        for _ in range(max(0, self.attempts - 1)):
            yield min(self.cap, wait) * random.uniform(1 - JITTER, 1 + JITTER)
            wait *= self.factor


def split_deadline(storage_options: dict | None) -> tuple[float, dict]:
    """(the deadline, storage_options without it: fsspec does not know the key); a
    PackError for a deadline that is not a positive number of seconds."""
    options = dict(storage_options or {})
    deadline = options.pop("deadline", None)
    if deadline is None:
        return DEADLINE, options
    if isinstance(deadline, bool) or not isinstance(deadline, numbers.Real) or not 0 < deadline < float("inf"):
        raise PackError(f"storage_options deadline must be a positive number of seconds (default {DEADLINE:g}), "
                        f"not {deadline!r}")
    return float(deadline), options


def bounded(fs, timeout: float) -> dict:
    """The keyword arguments that bound one call of fs's to timeout seconds: fsspec's async
    filesystems take timeout= and cancel the request when it runs out. A synchronous one
    takes none: its attempts are bounded only by its own timeouts and the deadline between them."""
    return {"timeout": max(timeout, 0.01)} if getattr(fs, "async_impl", False) else {}


def with_retries(url: str, call: Callable[[float], T], retries: int = RETRIES, doing: str = "reading",
                 storage_options: dict | None = None, backoff: Backoff | None = None,
                 sleep: Callable[[float], None] = time.sleep, deadline: float = DEADLINE, what: str = "") -> T:
    """call(seconds left), tried again on transient errors until deadline seconds have
    passed; a RemoteError naming url when it gives up, or at once on any other error.
    what: the request in words, for the deadline's message ("the object's size")."""
    backoff = backoff or Backoff(attempts=max(1, int(retries)))
    waits = backoff.waits()
    start = time.monotonic()
    deadline, whole = time_left(deadline)
    if deadline <= 0:
        raise past_whole(url, doing, what)
    attempts = 0
    while True:
        attempts += 1
        try:
            return call(deadline - (time.monotonic() - start))
        except RemoteError as exc:
            if not is_transient(exc):
                raise
            last = exc
        except Exception as exc:  # fsspec backends raise their own kinds (botocore, aiohttp, OSError)
            if not is_transient(exc):
                raise failure(url, exc, doing, storage_options) from cause(exc)
            last = exc
        wait = next(waits, None)
        spent = time.monotonic() - start
        if spent >= deadline or (wait is not None and spent + wait >= deadline):
            if whole and (last.kind if isinstance(last, RemoteError) else classify(last)) == TIMEOUT:
                raise past_whole(url, doing, what) from cause(last)
            raise past_deadline(url, last, doing, what, deadline, spent, attempts, storage_options) from cause(last)
        if wait is None:
            raise failure(url, last, doing, storage_options, retried=backoff.attempts > 1) from cause(last)
        sleep(wait)


def past_whole(url: str, doing: str, what: str) -> RemoteError:
    """The error of a request cut short because the whole operation (within()) ran out."""
    seconds = _whole[1] if _whole is not None else DEADLINE
    return RemoteError(
        f"{url}: {f'{doing} {what}'.strip()} did not finish within the {seconds:g} s deadline of the whole "
        "operation (all of its requests together): the server answers too slowly, or not at all; check the link "
        "and the server, or, on a slow link, allow more with --deadline SECONDS (storage_options "
        "{\"deadline\": SECONDS})", url, TIMEOUT)


def past_deadline(url: str, last: BaseException, doing: str, what: str, deadline: float, spent: float,
                  attempts: int, storage_options: dict | None = None) -> RemoteError:
    """The error of an operation that ran out of time: where, what, how long, and the way out."""
    request = f"{doing} {what}".strip()
    spent_words = f"{attempts} attempt(s) over {spent:.1f} s"
    more = "on a slow link, allow more with storage_options {\"deadline\": SECONDS} (the CLI's --deadline)"
    kind = last.kind if isinstance(last, RemoteError) else classify(last)
    if kind != TIMEOUT:  # it failed fast, again and again: say why, and when packer stopped trying
        why = failure(url, last, doing, storage_options, retried=True)
        return RemoteError(f"{why}; gave up {request} at the {deadline:g} s deadline ({spent_words})", url, why.kind)
    return RemoteError(
        f"{url}: {request} did not finish within the {deadline:g} s deadline ({spent_words}; the last: "
        f"{describe(last)}): the server took the connection but did not answer in time, or not at all; check "
        f"that it is up and the endpoint is right, or, {more}", url, TIMEOUT)
