"""Byte sources for readers: ranged reads of a remote object, through a block cache.

A packed dataset is read with one positional read per record at a known extent (see
packer.formats._io), so reading one from object storage or a web server is the same
reads as byte-range requests. A reader's descriptor slot holds either a plain file
descriptor (local: os.pread, unchanged) or a RemoteSource, whose pread(size, offset)
serves the range from fixed-size blocks of the object:

  memory   the last few blocks fetched, per process
  disk     cache_dir's BlockCache, shared by the workers and ranks of one machine
  remote   one ranged GET per block (or per record: below), retried with backoff

With a disk cache, reads fetch whole blocks (the next epoch reads the cache), and a
sampler's hints (will_need) fetch the blocks ahead in a background thread pool, several
at once, so a block-ordered epoch streams at about the link's bandwidth. One process at a
time fetches a block (BlockCache.lock_fetch): the read-ahead, run in the DataLoader's main
process, and the workers' own reads and hints share each fetch. Without a cache, a
read fetches exactly its own bytes (random order must not pay a block per record) and
hints do nothing.

Remote is anything fsspec opens by URL (s3://, gs://, https://, ...), with the
`packer[remote]` extra installed. An object is identified by its ETag, size and
modification time as the store reports them: that identity is in every cache key, so a
replaced object never mixes with blocks of the one before, and a reader opened before
a replacement refuses the new object rather than mixing the two.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import io
import logging
import os
import posixpath
import threading
import traceback
import urllib.parse

from ..errors import CorruptDataError, FormatError, redact
from . import is_url as _is_url, scheme_of
from .cache import BlockCache, parse_bytes
from .errors import MISSING, RemoteError
from .retry import RETRIES, bounded, split_deadline, with_retries
from .schemes import named, scheme_for

EXTRA = "packer[remote]"
DEFAULT_BLOCK_SIZE = 8 << 20
DEFAULT_CACHE_LIMIT = 50 * 10**9
MEMORY_BLOCKS = 4  # the last blocks read, kept in memory too (the page cache holds the rest)
FETCH_THREADS = 8  # background block fetches in flight per process
# Seconds to connect, and seconds without a byte, before an HTTP(S) read gives up (a
# transient error: retried with backoff). aiohttp's own default waits 5 minutes on a
# stuck server, each try, so a dead one would take half an hour to report.
HTTP_TIMEOUTS = {"sock_connect": 10.0, "sock_read": 60.0}


def missing(exc: BaseException) -> bool:
    """Whether exc says the object is not there (404), as opposed to unreachable or refused."""
    return isinstance(exc, RemoteError) and exc.kind == MISSING


def dataset_object_identity(remote, where: str, url: str, absent: str) -> tuple:
    """The identity of the object at where, the one a dataset at url is read from; a
    FormatError saying `absent` where there is no such object."""
    try:
        return remote.identity(where)
    except RemoteError as exc:
        if missing(exc):
            raise FormatError(f"{url}: {absent}", url) from exc
        raise


def is_url(path) -> bool:
    """Whether path names a remote object (scheme://...) rather than a local path."""
    return _is_url(path)


def join(url: str, *names: str) -> str:
    return posixpath.join(url.rstrip("/"), *names)


def filesystem(url: str, storage_options: dict):
    """(fsspec filesystem, path within it) for url; an ImportError naming the extra when
    fsspec, or the package of url's scheme (s3fs, gcsfs, aiohttp), is missing."""
    try:
        import fsspec.core
    except ImportError as exc:
        raise ImportError(f"reading {redact(url)} needs fsspec: pip install '{EXTRA}'") from exc
    try:
        redact_backend_logs()
        url, hidden = secrets_as_options(url)
        fs, path = fsspec.core.url_to_fs(url, **with_http_timeouts(url, one_attempt(url, storage_options)), **hidden)
    except ImportError as exc:
        raise ImportError(f"reading {redact(url)} needs a package packer's remote extra installs ({exc}): "
                          f"pip install '{EXTRA}'") from exc
    if hasattr(fs, "retries") and isinstance(fs.retries, int):
        fs.retries = 1  # s3fs retries some errors itself: leave retrying to packer.remote.retry
    return fs, path


# The loggers of the backends that may log a request's URL, or an error whose text holds it.
BACKEND_LOGGERS = ("fsspec", "fsspec.http", "s3fs", "gcsfs", "aiohttp.client")


class Redacting(logging.Filter):
    """Redacts the credentials of every URL in a backend's log line and in the traceback it
    carries: a request's query (a presigned URL's signature) is part of the URL requested,
    so the backend's own errors hold it, whatever options carry it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        record.msg, record.args = redact(message), ()
        return True


_REDACTING = Redacting()


def redact_backend_logs() -> None:
    """Put the Redacting filter on each backend logger (once: a filter is added once)."""
    for name in BACKEND_LOGGERS:
        logging.getLogger(name).addFilter(_REDACTING)


def secrets_as_options(url: str) -> tuple[str, dict]:
    """(url without its user, password and query, the request options that carry them) for
    an http(s) URL, whose backend (fsspec's HTTP filesystem) logs every URL it requests at
    DEBUG: given as options (aiohttp's auth= and params=), the credentials never reach a log
    line, whatever the user's logging. Any other URL as it is, with no options."""
    if scheme_for(scheme_of(url)).client != "aiohttp":
        return url, {}
    parts = urllib.parse.urlsplit(url)
    options = {}
    if parts.username is not None or parts.password is not None:
        import aiohttp

        options["auth"] = aiohttp.BasicAuth(urllib.parse.unquote(parts.username or ""),
                                            urllib.parse.unquote(parts.password or ""))
    if parts.query:
        options["params"] = parts.query  # as written: a signature covers its exact encoding
    if not options:
        return url, {}
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port is not None else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", parts.fragment)), options


# An s3:// request's botocore client: one attempt, bounded. packer.remote.retry is the one
# that retries; botocore's and s3fs's own attempts inside each of its attempts made a dead
# endpoint take some 50 s to report instead of about 8.
S3_CLIENT = {"retries": {"max_attempts": 1}, "connect_timeout": 10, "read_timeout": 60}


def one_attempt(url: str, storage_options: dict | None) -> dict:
    """storage_options for url: a botocore client (s3://) gets S3_CLIENT, under the caller's
    own config_kwargs."""
    options = dict(storage_options or {})
    if scheme_for(scheme_of(url)).client == "botocore":
        options["config_kwargs"] = {**S3_CLIENT, **(options.get("config_kwargs") or {})}
    return options


def with_http_timeouts(url: str, storage_options: dict) -> dict:
    """storage_options for reading url: an HTTP(S) URL gets HTTP_TIMEOUTS, unless the
    caller's options or fsspec's configuration already give its client_kwargs."""
    if scheme_for(scheme_of(url)).client != "aiohttp" or "client_kwargs" in storage_options:
        return storage_options
    import fsspec.config
    if any("client_kwargs" in (fsspec.config.conf.get(name) or {}) for name in named("aiohttp")):
        return storage_options
    import aiohttp  # fsspec's HTTP filesystem needs it too: url_to_fs names the extra if missing
    return {**storage_options, "client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, **HTTP_TIMEOUTS)}}


def _quote(info: dict, *keys) -> str:
    for key in keys:
        if info.get(key) not in (None, ""):
            return str(info[key])
    return ""


def identity_of(info: dict, url: str) -> tuple[str, int, str]:
    """(ETag, size, modification time) of a remote object from fsspec's info()."""
    size = info.get("size")
    if type(size) is not int or size < 0:
        raise RemoteError(f"{url}: the server does not say how large the object is (no Content-Length); "
                          "packer reads remote objects by byte ranges and needs their size", url)
    return (_quote(info, "ETag", "etag", "md5Hash", "Digest"), size,
            _quote(info, "LastModified", "Last-Modified", "updated", "mtime", "generation"))


class Remote:
    """How to read remote objects: storage options and cache settings. Plain data that
    pickles into DataLoader workers; each process opens its own filesystem and pools."""

    def __init__(self, storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, block_size: int | str | None = None,
                 retries: int = RETRIES):
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ValueError(f"storage_options must be a dict, not {type(storage_options).__name__}")
        self.deadline, self.storage_options = split_deadline(storage_options)
        self.cache_dir = None if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self.block_size = DEFAULT_BLOCK_SIZE if block_size is None else parse_bytes(block_size, "block_size")
        if self.block_size < 4096:
            raise ValueError(f"block_size must be at least 4096 bytes, not {self.block_size}")
        self.cache_limit = (DEFAULT_CACHE_LIMIT if cache_limit is None
                            else parse_bytes(cache_limit, "cache_limit"))
        self.retries = max(1, int(retries))

    def fs(self, url: str):
        return filesystem(url, self.storage_options)

    def info(self, url: str) -> dict:
        fs, path = self.fs(url)
        return self.attempts(url, lambda timeout: fs.info(path, **bounded(fs, timeout)), "its size")

    def attempts(self, url: str, call, what: str):
        """call(seconds left) with this Remote's retries and deadline (packer.remote.retry)."""
        return with_retries(url, call, self.retries, storage_options=self.storage_options, deadline=self.deadline,
                            what=what)

    def identity(self, url: str) -> tuple[str, int, str]:
        return identity_of(self.info(url), url)

    def exists(self, url: str) -> bool:
        """Whether url is an object (fsspec's isfile would say False for a server that is down)."""
        try:
            return self.info(url).get("type", "file") == "file"
        except RemoteError as exc:
            if exc.kind == MISSING:
                return False
            raise

    def open(self, url: str, identity: tuple | None = None) -> "RemoteSource":
        """A byte source of url; identity: the object it must be (else a CorruptDataError)."""
        found = self.identity(url)
        if identity is not None and found != identity:
            raise CorruptDataError(f"{url} was replaced since this Dataset was created (re-create the Dataset / "
                                   "restart the DataLoader)", url)
        return RemoteSource(self, url, found)

    def read_object(self, url: str, limit: int | None = None, identity: tuple | None = None) -> bytes:
        """The whole of a small object (an index, a table), through the cache; RemoteError
        when it is larger than limit."""
        source = self.open(url, identity)
        if limit is not None and source.size > limit:
            raise RemoteError(f"{url}: {source.size} bytes, more than the {limit} this file may hold", url)
        data = source.pread(source.size, 0)
        if len(data) != source.size:
            raise CorruptDataError(f"{url}: {len(data)} bytes read, the server says {source.size}", url)
        return data

    def __repr__(self) -> str:
        return (f"Remote(cache_dir={self.cache_dir!r}, cache_limit={self.cache_limit}, block_size={self.block_size}, "
                f"deadline={self.deadline:g})")


class _Process:
    """This process's shared state: memory blocks, fetches in flight, the fetch pool.
    Rebuilt in a forked child (its threads do not survive fork)."""

    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.memory: collections.OrderedDict = collections.OrderedDict()  # (key, block) -> bytes
        self.memory_bytes = 0
        self.inflight: dict = {}  # (key, block) -> Future
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.caches: dict = {}  # (dir, limit) -> BlockCache
        self.fetched_bytes = 0  # from servers, by every source of this process
        self.requests = 0

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="packer-fetch")
        return self.pool


_log = threading.local()  # .reads: (source, offset, size) of this thread's reads since start_log()


def start_log() -> None:
    """Note every remote read this thread makes from now (to re-fetch a record that failed its check)."""
    _log.reads = []


def stop_log() -> list:
    """The reads noted since start_log(), and stop noting."""
    reads = getattr(_log, "reads", None) or []
    _log.reads = None
    return reads


def remote_for(path, storage_options=None, cache_dir=None, cache_limit=None, block_size=None,
               **others) -> Remote | None:
    """The Remote to read path with where it is a URL, else None; remote options given
    for a local path are an error (they would be silently ignored)."""
    if others:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(others))}")
    options = {"storage_options": storage_options, "cache_dir": cache_dir, "cache_limit": cache_limit,
               "block_size": block_size}
    if is_url(path):
        return Remote(**options)
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise ValueError(f"{path}: {', '.join(given)} only apply to a dataset named by URL (s3://, gs://, "
                         "https://...), not to a local path")
    return None


_state: _Process | None = None
_state_lock = threading.Lock()


def _lock_of_its_own() -> None:
    """A child os.fork() made takes a new lock: a parent's thread holding it at the fork
    would never give the child's copy back."""
    global _state_lock
    _state_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_lock_of_its_own)


def fetched() -> tuple[int, int]:
    """(bytes, requests) this process has fetched from servers for reads, all sources together."""
    state = process_state()
    return state.fetched_bytes, state.requests


def in_flight() -> int:
    """Block fetches this process has started (read-ahead included) and not finished."""
    state = process_state()
    with state.lock:
        return len(state.inflight)


def process_state() -> _Process:
    global _state
    state = _state
    if state is None or state.pid != os.getpid():
        with _state_lock:
            if _state is None or _state.pid != os.getpid():
                _state = _Process()
            state = _state
    return state


class RemoteSource:
    """pread(size, offset) over one remote object, by blocks (see the module docstring).

    Counts what it fetched (fetched_bytes, requests) so tests and users can see that
    opening a dataset reads its tables, not the whole object."""

    def __init__(self, remote: Remote, url: str, identity: tuple):
        self.remote, self.url, self.identity = remote, url, identity
        self.size = identity[1]
        self.block_size = remote.block_size
        self.key = hashlib.sha256(repr((url, identity, self.block_size)).encode()).hexdigest()[:32]
        self.fs, self.path = remote.fs(url)
        state = process_state()
        self.disk = None
        if remote.cache_dir is not None:
            where = (remote.cache_dir, remote.cache_limit)
            self.disk = state.caches.get(where) or state.caches.setdefault(where, BlockCache(*where))
        self.memory_limit = MEMORY_BLOCKS * self.block_size
        self.fetched_bytes = 0
        self.requests = 0

    # -- reading ---------------------------------------------------------------------------
    def pread(self, size: int, offset: int) -> bytes:
        """size bytes at offset; shorter only at the end of the object."""
        end = min(offset + size, self.size)
        if end <= offset:
            return b""
        log = getattr(_log, "reads", None)
        if log is not None:
            log.append((self, offset, end - offset))
        first, last = offset // self.block_size, (end - 1) // self.block_size
        if self.disk is None and last > first and not all(self.cached(b * self.block_size)
                                                          for b in range(first, last + 1)):
            return self.fetch(offset, end)  # one request, not one per block it crosses
        parts = []
        for block in range(first, last + 1):
            start = block * self.block_size
            lo, hi = max(offset, start) - start, min(end, start + self.block_size) - start
            parts.append(self.block_range(block, lo, hi))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def block_range(self, block: int, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) of block: from memory, an in-flight fetch, disk, or the server."""
        state = process_state()
        key = (self.key, block)
        with state.lock:
            data = state.memory.get(key)
            if data is not None:
                state.memory.move_to_end(key)
                return data[lo:hi]
            future = state.inflight.get(key)
        if future is not None:
            data = future.result()
            if data is not None:
                return data[lo:hi]
            # a read-ahead that left the block to another process fetching it: look again
        if self.disk is not None:
            found = self.disk.read(self.key, block, self.block_length(block), lo, hi)
            if found is not None:
                return found
            return self.fetch_block(block)[lo:hi]
        start = block * self.block_size  # no disk cache, not hinted: exactly these bytes
        return self.fetch(start + lo, start + hi)

    def block_length(self, block: int) -> int:
        return min(self.block_size, self.size - block * self.block_size)

    def fetch_block(self, block: int) -> bytes:
        """Block from the server (one request shared by every thread asking), kept in memory and on disk."""
        state = process_state()
        key = (self.key, block)
        while True:
            with state.lock:
                future = state.inflight.get(key)
                mine = future is None
                if mine:
                    future = state.inflight[key] = concurrent.futures.Future()
            data = self.fill(block, future) if mine else future.result()
            if data is not None:  # None: a read-ahead left it to another process; wait for that one
                return data

    def fill(self, block: int, future: concurrent.futures.Future, wait: bool = True) -> bytes | None:
        """Fetch block, keep it, and resolve future (registered in flight) with it. With
        wait=False (read-ahead), None where another process is fetching the block."""
        state = process_state()
        key = (self.key, block)
        try:
            data = self.fetch_whole(block) if self.disk is None else self.fetch_once(block, wait)
            if data is not None:
                self.remember(key, data)
            future.set_result(data)
            return data
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with state.lock:
                state.inflight.pop(key, None)

    def fetch_whole(self, block: int) -> bytes:
        start = block * self.block_size
        return self.fetch(start, start + self.block_length(block))

    def fetch_once(self, block: int, wait: bool = True) -> bytes | None:
        """Block from the disk cache, or fetched and published there by this process alone:
        a process fetching it already is waited for (BlockCache.lock_fetch), or with
        wait=False left to it (None)."""
        length = self.block_length(block)
        fd = self.disk.lock_fetch(self.key, block, wait)
        if fd is None:
            return None
        try:
            data = self.disk.read(self.key, block, length, 0, length)
            if data is None:
                data = self.fetch_whole(block)
                self.disk.write(self.key, block, data)
            return data
        finally:
            self.disk.unlock_fetch(self.key, block, fd)

    def remember(self, key, data: bytes) -> None:
        state = process_state()
        with state.lock:
            if key not in state.memory:
                state.memory[key] = data
                state.memory_bytes += len(data)
            while state.memory_bytes > self.memory_limit and state.memory:
                _, old = state.memory.popitem(last=False)
                state.memory_bytes -= len(old)

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes [start, end) from the server: one ranged request, retried on transient errors."""
        def get(timeout: float) -> bytes:
            data = self.fs.cat_file(self.path, start=start, end=end, **bounded(self.fs, timeout))
            if len(data) != end - start:
                raise OSError(f"short read: {len(data)} of {end - start} bytes at {start}")
            return data
        data = self.remote.attempts(self.url, get, f"bytes {start}-{end - 1}")
        state = process_state()
        with state.lock:
            self.fetched_bytes += len(data)
            self.requests += 1
            state.fetched_bytes += len(data)
            state.requests += 1
        return data

    # -- hints, state ----------------------------------------------------------------------
    def will_need(self, offset: int, length: int) -> None:
        """Fetch the blocks of [offset, offset + length) in the background, into the disk cache.

        Nothing without a cache_dir: the sampler that hints runs in the DataLoader's main
        process, and blocks kept in its memory would be fetched for nobody (each worker
        reads its own records)."""
        if length <= 0 or self.disk is None:
            return
        state = process_state()
        last = min(offset + length, self.size) - 1
        for block in range(offset // self.block_size, last // self.block_size + 1):
            if self.cached(block * self.block_size):
                continue
            key = (self.key, block)
            with state.lock:  # in flight from now, so a read waits for it rather than fetching it too
                if key in state.inflight or key in state.memory:
                    continue
                future = state.inflight[key] = concurrent.futures.Future()
            state.executor().submit(self._prefetch, block, future)

    def _prefetch(self, block: int, future: concurrent.futures.Future) -> None:
        try:
            self.fill(block, future, wait=False)
        except Exception:  # already given to any read waiting on the future, which raises it
            pass

    def cached(self, offset: int) -> bool:
        """Whether the block holding offset is in memory, being fetched, or in the disk cache."""
        state = process_state()
        block = offset // self.block_size
        key = (self.key, block)
        with state.lock:
            if key in state.memory or key in state.inflight:
                return True
        return self.disk is not None and self.disk.has(self.key, block, self.block_length(block))

    def invalidate(self, offset: int, length: int) -> None:
        """Forget the cached blocks of a range (memory and disk), so the next read fetches them again."""
        state = process_state()
        last = min(offset + max(length, 1), self.size) - 1
        for block in range(offset // self.block_size, last // self.block_size + 1):
            with state.lock:
                data = state.memory.pop((self.key, block), None)
                if data is not None:
                    state.memory_bytes -= len(data)
            if self.disk is not None:
                self.disk.drop(self.key, block)

    def close(self) -> None:
        """Nothing to release: blocks stay cached for the next source of this object."""

    def __repr__(self) -> str:
        return f"RemoteSource({redact(self.url)!r}, size={self.size})"


class SourceFile(io.RawIOBase):
    """A read-only, seekable file object over a byte source (h5py opens one)."""

    def __init__(self, source: RemoteSource):
        super().__init__()
        self.source, self.position = source, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.position, 2: self.source.size}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset} before the start of {self.source.url}")
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        data = self.source.pread(len(buffer), self.position)
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self.source.size - self.position)
        data = self.source.pread(size, self.position)
        self.position += len(data)
        return data
