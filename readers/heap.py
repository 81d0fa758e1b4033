"""Keeps a DataLoader worker's freed heap for its next batch instead of faulting it back in (glibc).

glibc's malloc gives memory back to the kernel once 128 KiB lie free at the top of the
heap, and serves allocations from 128 KiB up with mappings of their own (that threshold
drifts up with what is freed). A worker allocates a batch of samples (the bytes read,
the arrays decoded: 100 KB to 1 MB each), hands the batch over and frees them together;
the heap shrinks, and the next batch's reads fault every page back in, zero-filled, one
4 KiB page at a time. On the 2-core machine of docs/benchmarks.md that was over half the
time of a warm raw read through a DataLoader at batch 256 ("A worker's heap").

keep_heap() fixes both thresholds in this process: up to 128 MiB freed at the heap's
top stays for the next batch (a batch of 256 records of 100-500 KB), instead of going
back to be faulted in again. A batch larger than that goes back once freed, as with
glibc's defaults, so a worker that once reads a huge batch does not hold it for good;
allocations of 32 MiB and more still get their own mappings and go back when freed.

Done once per worker process, by make_loader's worker set-up and by a packer Dataset's
first batch in a DataLoader worker; never in the main process, whose allocator stays
the user's, nor where the user tuned glibc's malloc (a MALLOC_* variable or
glibc.malloc.* in GLIBC_TUNABLES): those settings stand. PACKER_KEEP_HEAP=0 turns it
off. Other C libraries are left alone.

readers.threads' background process is different: its threads each took an arena of
their own from glibc and kept a batch's worth of freed samples in it (30 MB each at
batches of 64 decoded 224x224 images). share_one_heap() has them all allocate from the
main heap (M_ARENA_MAX 1: their big buffers are allocated and freed a few hundred times
a second, so the lock is not contended), and trim_heap() gives the free pages back after
each batch (malloc_trim): what stays is what the batches in flight use. The same
exceptions hold (PACKER_KEEP_HEAP=0, a user-tuned malloc).
"""
from __future__ import annotations

import ctypes
import os
import sys

import torch.utils.data

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's <malloc.h>
TRIM_THRESHOLD = 128 << 20  # free memory at the heap's top kept, at most
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit
ENV = "PACKER_KEEP_HEAP"

_decided_in: int | None = None  # the process that decided (a forked child decides again)
_kept = False
_trim = None  # glibc's malloc_trim, once share_one_heap() has set this process up


def keep_heap() -> bool:
    """Fix glibc's trim and mmap thresholds in this process (see the module's text).

    True once they are set; False where PACKER_KEEP_HEAP=0 or the C library is not glibc."""
    global _decided_in, _kept
    if _decided_in == os.getpid():
        return _kept
    _decided_in, _kept = os.getpid(), False
    if os.environ.get(ENV, "1") == "0" or user_tuned_malloc():
        return False
    libc = glibc()
    if libc is not None:
        _kept = (bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
                 and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    return _kept


def keep_heap_in_worker() -> bool:
    """keep_heap() in a DataLoader worker; in any other process nothing, and False."""
    if _decided_in == os.getpid():
        return _kept
    if torch.utils.data.get_worker_info() is None:
        return False
    return keep_heap()


def share_one_heap() -> bool:
    """Every thread of this process allocates from glibc's main heap (see the module's
    text); True once set, False where PACKER_KEEP_HEAP=0, malloc is tuned by the user or
    the C library is not glibc (trim_heap then does nothing)."""
    global _trim
    if os.environ.get(ENV, "1") == "0" or user_tuned_malloc():
        return False
    libc = glibc()
    if libc is None or not libc.mallopt(M_ARENA_MAX, 1):
        return False
    _trim = libc.malloc_trim
    return True


def trim_heap() -> None:
    """Give the heap's free pages back to the kernel, after share_one_heap() (a batch is done)."""
    if _trim is not None:
        _trim(0)


def user_tuned_malloc() -> bool:
    """Whether glibc's malloc was tuned through the environment (MALLOC_TRIM_THRESHOLD_,
    MALLOC_ARENA_MAX, ... or glibc.malloc.* tunables): then the workers' allocator stays
    the user's."""
    return any(name.startswith("MALLOC_") for name in os.environ) or \
        "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def glibc():
    """This process's C library when it is glibc on Linux (the only one whose mallopt
    this module knows), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError, TypeError):
        return None
