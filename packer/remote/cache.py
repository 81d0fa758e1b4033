"""A directory of fixed-size blocks of remote objects, bounded in bytes, shared by processes.

  <cache_dir>/<object key>/<block:010d>        one block of one object, exactly its length
  <cache_dir>/<object key>/<block:010d>.fetch  empty; flock'ed while one process fetches the block
  <cache_dir>/.lock                            flock'ed around eviction and publishing

The object key (RemoteSource.key) hashes the URL, the object's identity (ETag, size,
modification time) and the block size, so a replaced object, or another block size,
never reads blocks of the one before. Every DataLoader worker and rank on a machine may
use one cache_dir at once:

- a block is written to a temporary name and renamed into place, so a reader sees a
  whole block or none; its length is checked on every read, so a file cut short (a crash
  before the data reached the disk) counts as missing and is fetched again;
- publishing takes the lock, adds up the blocks present and removes the least recently
  used ones (oldest modification time; a read touches its block, at most once a second)
  until the new block fits under the limit, then renames the block in. The limit holds
  at every moment outside that lock. A block larger than the whole limit is not kept.
- a reader of a block another process evicts keeps its open descriptor or finds the
  block missing and fetches it again; removing a file never breaks a read in progress.
- a block is fetched by one process at a time: the fetcher holds an flock on the block's
  .fetch file (the kernel releases it if the process dies) and removes the file once the
  block is published; a process wanting the same block waits on that lock, then finds
  the block cached, so the main process's read-ahead and the workers' reads never fetch
  a block twice. A waiter that wakes on a file already removed locks the new one instead.
"""
from __future__ import annotations

import fcntl
import os
import re
import threading
import time

LOCK_NAME = ".lock"
FETCH_SUFFIX = ".fetch"
TOUCH_EVERY = 1.0  # seconds between mtime updates of one block by one process
STALE_TEMP = 3600.0  # a temporary file this old belongs to a process that died
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_bytes(value, name: str) -> int:
    """An int, or a size written "50GB" (powers of 1000), "512MiB" (powers of 1024), "4096"."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ValueError(f"{name}: {value!r} is not a size (write e.g. 50GB, 512MiB or a byte count)")
        power = " KMGT".index(match.group(2).upper() or " ")
        number = int(float(match.group(1)) * (1024 if match.group(3) else 1000) ** power)
    if number < 0:
        raise ValueError(f"{name} must not be negative, not {value!r}")
    return number


class BlockCache:
    def __init__(self, root: str, limit: int):
        self.root, self.limit = root, limit
        os.makedirs(root, exist_ok=True)
        self.lock_path = os.path.join(root, LOCK_NAME)
        self.touched: dict = {}
        self.thread_lock = threading.Lock()  # flock is per open file: threads queue here first

    def path(self, key: str, block: int) -> str:
        return os.path.join(self.root, key, f"{block:010d}")

    def read(self, key: str, block: int, length: int, lo: int, hi: int) -> bytes | None:
        """Bytes [lo, hi) of the block, or None when it is not cached whole."""
        where = self.path(key, block)
        try:
            fd = os.open(where, os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != length:
                return None
            data = os.pread(fd, hi - lo, lo)
        finally:
            os.close(fd)
        if len(data) != hi - lo:
            return None
        self.touch(where)
        return data

    def has(self, key: str, block: int, length: int) -> bool:
        try:
            return os.stat(self.path(key, block)).st_size == length
        except OSError:
            return False

    def touch(self, where: str) -> None:
        now = time.monotonic()
        if now - self.touched.get(where, -TOUCH_EVERY) >= TOUCH_EVERY:
            self.touched[where] = now
            try:
                os.utime(where)
            except OSError:  # evicted meanwhile
                pass

    def write(self, key: str, block: int, data: bytes) -> None:
        """Keep a block, evicting the least recently used ones to stay within the limit."""
        if len(data) > self.limit:
            return
        folder = os.path.join(self.root, key)
        os.makedirs(folder, exist_ok=True)
        final = self.path(key, block)
        temp = f"{final}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(temp, "wb") as f:
            f.write(data)
        try:
            with self.locked():
                self.make_room(len(data), final)
                os.makedirs(folder, exist_ok=True)  # eviction may have removed an emptied folder
                os.replace(temp, final)
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise

    def lock_fetch(self, key: str, block: int, wait: bool = True) -> int | None:
        """Hold the block's fetch lock, waiting while another process (or thread) holds it;
        returns the descriptor to give unlock_fetch. The caller then looks in the cache
        first: the holder it waited for has usually just published the block. With
        wait=False: None at once where another holds it (a read-ahead leaves it to them)."""
        where = self.path(key, block) + FETCH_SUFFIX
        mode = fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB
        while True:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            fd = os.open(where, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, mode)
                if os.fstat(fd).st_ino == os.stat(where).st_ino:
                    return fd
            except FileNotFoundError:  # the holder removed it as it finished: lock the next one
                pass
            except BlockingIOError:
                os.close(fd)  # never locked
                return None
            except BaseException:
                release(fd)
                raise
            release(fd)  # locked a file its holder removed since: lock the next one

    def unlock_fetch(self, key: str, block: int, fd: int) -> None:
        """Release a fetch lock: the file goes first, so no one locks it after this."""
        _unlink(self.path(key, block) + FETCH_SUFFIX)
        release(fd)  # a waiter wakes, sees the file gone, and looks in the cache

    def locked(self):
        cache = self

        class Held:
            def __enter__(self):
                cache.thread_lock.acquire()
                try:
                    self.fd = os.open(cache.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
                    fcntl.flock(self.fd, fcntl.LOCK_EX)
                except BaseException:
                    cache.thread_lock.release()
                    raise

            def __exit__(self, *exc):
                try:
                    release(self.fd)
                finally:
                    cache.thread_lock.release()
        return Held()

    def blocks(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block present; stale temporary files are removed."""
        found = []
        now = time.time()
        for folder in os.scandir(self.root):
            if not folder.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(folder.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if ".tmp." in entry.name or entry.name.endswith(FETCH_SUFFIX):
                    if now - st.st_mtime > STALE_TEMP:  # left by a process that died
                        _unlink(entry.path)
                    continue
                found.append((st.st_mtime, st.st_size, entry.path))
        return found

    def used(self) -> int:
        return sum(size for _, size, _ in self.blocks())

    def make_room(self, needed: int, replacing: str) -> None:
        """Evict least recently used blocks until needed more bytes fit (lock held)."""
        present = [b for b in self.blocks() if b[2] != replacing]
        total = sum(size for _, size, _ in present)
        if total + needed <= self.limit:
            return
        present.sort()
        for _, size, where in present:
            _unlink(where)
            self.touched.pop(where, None)
            total -= size
            if total + needed <= self.limit:
                break

    def drop(self, key: str, block: int) -> None:
        _unlink(self.path(key, block))


def release(fd: int) -> None:
    """Unlock an flock'ed descriptor and close it. Closing alone would not do: a child forked
    while the lock was held shares the open file, and the lock would last as long as it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _unlink(where: str) -> None:
    try:
        os.unlink(where)
    except OSError:
        pass
