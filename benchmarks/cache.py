"""Controls and checks the page cache for a benchmark's data files, without root (compaction
needs it, and is skipped without).

Cold means: every data page of the source was dropped with
posix_fadvise(POSIX_FADV_DONTNEED) after an fsync (dirty pages cannot be dropped), and
mincore(2) then confirms how much is still resident. The kernel skips pages that some
process has mapped, so callers close readers (LMDB maps its file) before evicting; the
check catches any that stayed. Warm means: the files were evicted and then read from
start to end (again, up to RELOADS times, while mincore finds a page missing), and
mincore confirms every data page is resident. Evicting first means no case inherits the
pages an earlier cold random run brought in one at a time, and compacting free memory in
between (as root: compact()) that a reload lands in the small pieces its eviction freed.
It cannot make the memory behind the cache the same: on a VM that reclaims guest memory
(DAMON pageout, a balloon reporting free pages; see machine.memory_reclaim) the same
cached file copies out slower in some runs than in others. Only file data is evicted:
directory entries and inodes stay cached, and a hypervisor's or disk's own cache is out
of reach.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Iterable

import numpy as np

from packer.formats import CAN_ADVISE, evict  # noqa: F401  (cache.evict: the suites' cold state)

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
READ_CHUNK = 8 << 20
# Below COLD_MAX resident counts as evicted; at or above WARM_MIN as fully cached.
COLD_MAX = 0.02
WARM_MIN = 0.98
RELOADS = 3  # read-throughs after the first while some page is still not resident
CAN_EVICT = CAN_ADVISE  # posix_fadvise: Linux and most Unixes; not macOS or Windows
COMPACT = "/proc/sys/vm/compact_memory"


def data_files(path: str) -> list[str]:
    """Every regular file under path (or path itself): what a source reads."""
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        found += [os.path.join(root, f) for f in sorted(files)]
    return found


def can_compact() -> bool:
    """Whether this process may ask the kernel to compact free memory (Linux, root)."""
    return os.access(COMPACT, os.W_OK)


def compact() -> bool:
    """Have the kernel defragment free memory (a few ms), where this process may: a warm
    reload then gets large page-cache folios whatever ran before. Reloaded into the small
    pieces its own eviction left, a 2 GB pack copied out 20-25% slower, run after run, than
    the same pack reloaded after a compaction (benchmarks/results/NOTES.md). False where
    not allowed."""
    try:
        with open(COMPACT, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def load(paths: Iterable[str]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(READ_CHUNK):
                pass


def _libc():
    name = ctypes.util.find_library("c")
    if name is None or not CAN_EVICT:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    if not hasattr(libc, "mincore"):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str) -> tuple[int, int]:
    """(pages of path in the page cache, pages in path), by mincore on a fresh mapping."""
    resident = resident_map(path)
    return int(np.count_nonzero(resident)), len(resident)


def resident_map(path: str) -> np.ndarray:
    """Whether each page of path is in the page cache (bool per page), by mincore on a
    fresh mapping. Mapping a file does not read it, so the check leaves the cache as it was.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return np.zeros(0, dtype=bool)
        addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap failed: {os.strerror(err)}", path)
        try:
            n = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * n)()
            if _LIBC.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore failed: {os.strerror(err)}", path)
            return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)
        finally:
            _LIBC.munmap(addr, size)
    finally:
        os.close(fd)


def resident_fraction(paths: Iterable[str]) -> float | None:
    """Fraction of the files' pages in the page cache; None where mincore is unavailable."""
    if _LIBC is None:
        return None
    have = total = 0
    for p in paths:
        h, t = resident_pages(p)
        have, total = have + h, total + t
    return have / total if total else 0.0


def prepare(paths: list[str], state: str) -> float | None:
    """Make paths cold or warm; return the resident fraction measured afterwards."""
    if state == "cold":
        evict(paths)
    elif state == "warm":
        if CAN_EVICT:
            evict(paths)
        compact()
        load(paths)
        # One read-through right after evicting has left up to 1.2% of pages out here (cause
        # not pinned down); those would be disk reads inside a warm run, so fill the gaps.
        for _ in range(RELOADS):
            resident = resident_fraction(paths)
            if resident is None or resident >= 1.0:
                return resident
            load(paths)
    else:
        raise ValueError(f"cache state must be cold or warm, not {state!r}")
    return resident_fraction(paths)


def verdict(state: str, resident: list[float | None], after: list[float | None] = ()) -> tuple[bool | None, str]:
    """(verified, note) for the residency measured before each timed run of a case and,
    for warm runs, after it (a warm run lasts its whole budget: something may reclaim
    the cache meanwhile)."""
    if not resident or any(r is None for r in [*resident, *after]):
        return None, "page cache state unverified (mincore unavailable)"
    worst = max(resident) if state == "cold" else min(resident)
    if state == "cold" and worst > COLD_MAX:
        return False, f"eviction did not take effect: {worst:.0%} of the data stayed cached"
    if state == "warm" and worst < WARM_MIN:
        return False, f"only {worst:.0%} of the data fit in the page cache"
    if state == "warm" and after and min(after) < WARM_MIN:
        return False, f"the page cache lost data during a run: {min(after):.0%} still resident at its end"
    return True, ""
