"""Remote shards streamed front to back, several in flight, for the iterable WebDataset reader.

A shard is read by one background thread in sequential ranged GETs of CHUNK bytes
(each retried with backoff on a transient error, from where it stopped), into a
bounded queue the reader drains: a stream holds at most QUEUED chunks in memory,
however large the shard. ShardsAhead starts the next shards of a worker's list while
it parses the current one, so the link stays busy while samples are decoded.
"""
from __future__ import annotations

import collections
import io
import queue
import threading

from .retry import bounded
from .source import Remote

CHUNK = 4 << 20
QUEUED = 4  # chunks buffered per stream
_END = object()


class ShardStream(io.RawIOBase):
    """A raw, read-only, non-seekable stream of one remote object, fetched in the background."""

    def __init__(self, remote: Remote, url: str):
        super().__init__()
        self.remote, self.url = remote, url
        self.chunks: queue.Queue = queue.Queue(QUEUED)
        self.stopped = threading.Event()
        self.current, self.at = b"", 0
        self.done = False
        self.thread = threading.Thread(target=self.download, name="packer-shard-stream", daemon=True)
        self.thread.start()

    def download(self) -> None:
        try:
            fs, path = self.remote.fs(self.url)
            size = self.remote.identity(self.url)[1]
            offset = 0
            while offset < size and not self.stopped.is_set():
                end = min(size, offset + CHUNK)
                chunk = self.remote.attempts(self.url, lambda timeout: self.fetch(fs, path, offset, end, timeout),
                                             f"bytes {offset}-{end - 1}")
                self.put(chunk)
                offset = end
            self.put(_END)
        except BaseException as exc:  # handed to the reader, which raises it
            self.put(exc)

    @staticmethod
    def fetch(fs, path: str, start: int, end: int, timeout: float) -> bytes:
        data = fs.cat_file(path, start=start, end=end, **bounded(fs, timeout))
        if len(data) != end - start:
            raise OSError(f"short read: {len(data)} of {end - start} bytes at {start}")
        return data

    def put(self, item) -> None:
        while not self.stopped.is_set():
            try:
                self.chunks.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.current):
            if self.done:
                return 0
            item = self.chunks.get()
            if item is _END:
                self.done = True
                return 0
            if isinstance(item, BaseException):
                self.done = True
                raise item
            self.current, self.at = item, 0
        n = min(len(buffer), len(self.current) - self.at)
        buffer[:n] = self.current[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        self.stopped.set()
        super().close()


class ShardsAhead:
    """opener(url) for _tar.iter_samples over a list of shard URLs read in order: each call
    returns that shard's stream and keeps the next `ahead` shards streaming already."""

    def __init__(self, remote: Remote, urls: list[str], ahead: int = 2):
        self.remote, self.pending, self.ahead = remote, collections.deque(urls), max(0, int(ahead))
        self.started: collections.deque = collections.deque()  # (url, stream) in list order

    def __call__(self, url: str) -> ShardStream:
        while self.started and self.started[0][0] != url:  # a shard given up on (limit reached)
            self.started.popleft()[1].close()
        if self.started:
            stream = self.started.popleft()[1]
        else:
            if self.pending and self.pending[0] == url:
                self.pending.popleft()
            stream = ShardStream(self.remote, url)
        while len(self.started) < self.ahead and self.pending:
            next_url = self.pending.popleft()
            self.started.append((next_url, ShardStream(self.remote, next_url)))
        return stream

    def close(self) -> None:
        while self.started:
            self.started.popleft()[1].close()
