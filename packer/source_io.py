"""Reads one source file safely: regular files only, never blocking, never more than its size.

Used wherever packer opens a file of SRC (pack, verify --against, the folder reader). A
FIFO would block open() and read() forever, and a symlink to /dev/zero would read until
memory runs out; so the file is opened with O_NONBLOCK and the opened descriptor is
checked with fstat (not the path, which could be swapped between a check and the open),
then read up to the size fstat reported plus one byte, which reveals a file still growing.
"""
from __future__ import annotations

import errno
import os
import stat

from .errors import BadImageError

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "folder"))


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, from its st_mode."""
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "unknown file type")


def not_regular_reason(mode: int) -> str:
    return f"not a regular file ({file_kind(mode)})"


def open_regular_file(path: str, max_bytes: int | None = None) -> tuple[int, int]:
    """(a blocking descriptor of the regular file at path, its size), checked as
    read_regular_file checks it before reading; the caller closes the descriptor.

    Raises:
        OSError: it cannot be opened.
        BadImageError: it is not a regular file, or it is over max_bytes.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        describe_failed_open(path, exc)
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadImageError(path, not_regular_reason(info.st_mode))
        if max_bytes is not None and info.st_size > max_bytes:
            raise BadImageError(path, f"larger than {max_bytes // 2**20} MB ({info.st_size} bytes)")
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open; a network or FUSE file could EAGAIN with it
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_regular_file(path: str, max_bytes: int | None = None) -> bytes | bytearray:
    """The bytes of the regular file at path (a bytearray where it is too large for one
    read: see read_size); with max_bytes, a larger file is refused before it is read (its
    size as fstat reports it on the opened file).

    Raises:
        OSError: it cannot be opened or read (missing, permission denied, I/O error).
        BadImageError: it is not a regular file, it is over max_bytes, it changed size
            while being read, or it is too large to hold in memory; .reason says which.
    """
    fd, size = open_regular_file(path, max_bytes)
    try:
        return read_size(fd, size, path)
    finally:
        os.close(fd)


def describe_failed_open(path: str, exc: OSError) -> None:
    """Raise BadImageError when the open failed because path is not a regular file (a socket
    cannot be opened at all: ENXIO), so that it is named like the other kinds."""
    if exc.errno != errno.ENXIO:
        return
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise BadImageError(path, not_regular_reason(mode)) from exc


# The most one read() returns on Linux (2 GiB less a page): a larger file takes several reads.
MAX_ONE_READ = 0x7FFFF000


def read_size(fd: int, size: int, path: str) -> bytes | bytearray:
    """Read the `size` bytes fstat reported; one byte more, or fewer, means the file changed.

    Memory: the file's size once. A file that one read() returns whole comes back as the
    bytes that read made (resized in place to what came). A larger one, or one whose
    read comes back short (a network file system), is read into one bytearray made
    before its first read, never as pieces joined after (that held the file twice). A
    buffer that cannot be had is a BadImageError naming the file, never a MemoryError."""
    try:
        data = os.read(fd, size + 1) if size < MAX_ONE_READ else b""
        if len(data) < size:
            data = read_rest(fd, size, data)
        elif len(data) == size and os.read(fd, 1):
            data = None  # grew: the byte past the size fstat gave was there
    except MemoryError:
        raise BadImageError(path, f"too large to hold in memory ({size} bytes); free memory, or leave the file "
                                  "out of SRC") from None
    if data is None or len(data) != size:
        change = "then grew" if data is None or len(data) > size else f"only {len(data)} could be read"
        raise BadImageError(path, f"changed while being read ({size} bytes when opened, {change}); "
                                  "make sure nothing is writing to it")
    return data


def read_rest(fd: int, size: int, first: bytes) -> bytearray | None:
    """The file's bytes, `first` already read, in one bytearray filled in place (os.readv),
    cut to the bytes that came; None when more than size came (the file grew)."""
    buffer = bytearray(size + 1)
    buffer[:len(first)] = first
    got = len(first)
    with memoryview(buffer) as view:
        while got <= size:
            count = os.readv(fd, [view[got:]])
            if not count:
                break
            got += count
    if got > size:
        return None
    del buffer[got:]  # the spare byte, or what a short file left unread: shrunk in place, not copied
    return buffer
