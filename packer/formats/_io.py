"""Positional reads and page-cache advice shared by the readers.

Readers fetch a record with one pread of exactly its bytes instead of touching a memory
map: a page fault reads the kernel's whole read-around window (read_ahead_kb, 8 MB on
some virtual disks), so random faults on a cold file read far more than they use. The
access pattern a reader is told (random or sequential) becomes posix_fadvise advice on its
descriptors: RANDOM reads exactly what is asked, SEQUENTIAL reads ahead. will_need()
starts the kernel reading a byte range into the page cache in the background, which is
how a block sampler fetches the blocks it is about to use in large sequential reads, and
how a random-order sampler keeps many record reads in flight; cached() tells whether a
page is already there, so hints for a warm dataset can stop.
Where posix_fadvise is missing (macOS, Windows) the advice is skipped; reads still work.
advise_pages() is madvise over a range of this process's memory (a writer's map, a
batch's shared memory), on Linux; elsewhere it does nothing.

A descriptor here is a file descriptor or a byte source (packer.remote: a remote object
read by ranges through a block cache): the functions below serve both, so a format's
reads are the same code for both. The local path stays a plain os.pread: a source is
noticed only when os.pread refuses it (a try costs nothing in Python 3.11).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import sys

from ..source_io import not_regular_reason

ACCESS_PATTERNS = ("random", "sequential")
CAN_ADVISE = hasattr(os, "posix_fadvise")
CAN_PREAD = hasattr(os, "pread")  # not on Windows: readers that need it fall back
_ADVICE = {"random": "POSIX_FADV_RANDOM", "sequential": "POSIX_FADV_SEQUENTIAL"}
CAN_PROBE = hasattr(os, "RWF_NOWAIT") and hasattr(os, "preadv")
_PROBE = bytearray(1)  # cached()'s landing byte: its content is never used


MADV_DONTNEED = 4  # Linux's values
MADV_REMOVE = 9


def advise_pages(address: int, length: int, advice: int) -> bool:
    """madvise(advice) over the whole pages inside [address, address + length) (never a
    neighbour's page), through ctypes, which releases the GIL while the kernel works.
    False where nothing was done: no whole page inside, not Linux, or the kernel refused."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    stop = (address + length) // page * page
    if stop <= start or _MADVISE is None:
        return False
    return _MADVISE(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), advice) == 0


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def check_access(access: str) -> str:
    if access not in ACCESS_PATTERNS:
        raise ValueError(f"access must be one of {', '.join(ACCESS_PATTERNS)}, not {access!r}")
    return access


def open_for_reading(path: str, access: str) -> int:
    """A read-only descriptor for path, advised for the access pattern.

    Raises:
        OSError: it cannot be opened, or it is not a regular file (a FIFO in a dataset
            file's place would block open() and read() forever; O_NONBLOCK opens it).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, not_regular_reason(mode), path)
    os.set_blocking(fd, True)
    if CAN_ADVISE:
        os.posix_fadvise(fd, 0, 0, getattr(os, _ADVICE[access]))
    return fd


def pread(fd: int, size: int, offset: int) -> bytes:
    """size bytes at offset; shorter only at the end of the file (callers check)."""
    try:
        data = os.pread(fd, size, offset)
    except TypeError:
        if type(fd) is int:
            raise
        return fd.pread(size, offset)
    if len(data) == size or not data:
        return data
    return _pread_rest(fd, size, offset, data)


def _pread_rest(fd: int, size: int, offset: int, data: bytes) -> bytes:
    """Finish a pread that returned early (signals, some network file systems)."""
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def cached(fd: int, offset: int) -> bool:
    """Whether the page holding byte offset is in the page cache: a one-byte read that may
    not wait for the disk (RWF_NOWAIT, Linux >= 4.14). False where that cannot be asked."""
    if type(fd) is not int:
        return fd.cached(offset)
    if not CAN_PROBE:
        return False
    try:
        return os.preadv(fd, [_PROBE], offset, os.RWF_NOWAIT) == 1
    except OSError:  # BlockingIOError: not cached; EOPNOTSUPP: a file system that cannot say
        return False


def will_need(fd: int, offset: int, length: int) -> None:
    """Start reading [offset, offset + length) into the page cache without waiting for it."""
    if type(fd) is not int:
        return fd.will_need(offset, length)
    if CAN_ADVISE and length > 0:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


PROBES = 16  # pages probed at most before a range is hinted (will_need_uncached)
PROBE_STEP = 1 << 20  # about one probe a MiB, at least 3 a range


def will_need_uncached(fd: int, offset: int, length: int) -> bool:
    """will_need, unless the range is found in the page cache: a page probed in the middle
    of each of up to PROBES equal parts (about one a MiB; not its first or last page, which
    it may share with what lies around it). A hint of cached pages still walks each one
    (about 75 us for 6 MB); the probes cost a few us. True if hinted."""
    if length <= 0:
        return False
    parts = min(PROBES, max(3, length // PROBE_STEP))
    for k in range(parts):
        if not cached(fd, offset + (2 * k + 1) * length // (2 * parts)):
            will_need(fd, offset, length)
            return True
    return False


def file_size(fd) -> int:
    """The size of the file (or byte source) fd reads."""
    return os.fstat(fd).st_size if type(fd) is int else fd.size


def close(fd) -> None:
    """Close a descriptor or a byte source."""
    if type(fd) is int:
        os.close(fd)
    else:
        fd.close()


def evict(paths) -> None:
    """Drop each file's pages from the page cache (posix_fadvise DONTNEED; no root needed),
    after syncing it: dirty pages cannot be dropped."""
    for path in paths:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer forever. Only a regular
        # file has pages to drop; a FIFO, socket or device (or a symlink to one) is left for
        # the read that follows to refuse by name.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mapped_at(path: str) -> int | None:
    """Address where this process maps path from file offset 0 (Linux /proc), or None."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and fields[5] == real and int(fields[2], 16) == 0:
                    return int(fields[0].split("-")[0], 16)
    except OSError:
        return None
    return None
