"""The retry policy for remote reads and writes: transient errors again, with backoff.

A transient error (the server unreachable, slow, failing with 5xx or throttling; see
packer.remote.errors.is_transient) is tried again after a wait that starts at FIRST_WAIT
seconds and doubles up to MAX_WAIT, each wait jittered so that many workers that failed
together do not retry together. With the defaults a call is tried RETRIES times over about
eight seconds of waiting: long enough for a restarted server to come back, short enough
that a wrong endpoint is reported promptly. Anything else (missing object or bucket,
refused credentials, bad arguments) is reported at once: trying again cannot help.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from .errors import RemoteError, failure, is_transient

RETRIES = 6
FIRST_WAIT = 0.25
FACTOR = 2.0
MAX_WAIT = 8.0
JITTER = 0.25  # each wait is scaled by a random factor in [1 - JITTER, 1 + JITTER]

T = TypeVar("T")


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


def with_retries(url: str, call: Callable[[], T], retries: int = RETRIES, doing: str = "reading",
                 storage_options: dict | None = None, backoff: Backoff | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """call(), tried again on transient errors; a RemoteError naming url when it gives up or
    at once on any other error."""
    backoff = backoff or Backoff(attempts=max(1, int(retries)))
    waits = backoff.waits()
    while True:
        try:
            return call()
        except RemoteError as exc:
            if not is_transient(exc):
                raise
            last = exc
        except Exception as exc:  # fsspec backends raise their own kinds (botocore, aiohttp, OSError)
            if not is_transient(exc):
                raise failure(url, exc, doing, storage_options) from exc
            last = exc
        wait = next(waits, None)
        if wait is None:
            raise failure(url, last, doing, storage_options, retried=backoff.attempts > 1) from last
        sleep(wait)
