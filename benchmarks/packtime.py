"""Times `packer.pack` per format against `tar cf` of the same folder: the cost of moving the bytes.

The source is read into the page cache before every run, so each writer and tar start
from the same state, and tar's archive is fsynced as LMDB's pack fsyncs its database.
"""
from __future__ import annotations

import os
import subprocess
import time

from . import cache
from .case import summarise


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in cache.data_files(path))


def time_pack(folder: str, fmt: str, out: str, workers: int, repeat: int) -> dict:
    """Pack folder into out `repeat` times (the last one stays for the read cases)."""
    import packer

    files = cache.data_files(folder)
    seconds = []
    for _ in range(repeat):
        cache.load(files)
        start = time.perf_counter()
        packer.pack(folder, fmt, out, workers=workers, force=True, progress=False)
        seconds.append(time.perf_counter() - start)
    return {"status": "ok", "unit": "s", "workers": workers, "bytes": tree_bytes(out), **summarise(seconds)}


def time_tar(folder: str, out: str, repeat: int) -> dict:
    folder = os.path.abspath(folder)
    files = cache.data_files(folder)
    seconds = []
    for _ in range(repeat):
        if os.path.exists(out):
            os.remove(out)
        cache.load(files)
        start = time.perf_counter()
        subprocess.run(["tar", "cf", out, "-C", os.path.dirname(folder), os.path.basename(folder)],
                       check=True, stdout=subprocess.DEVNULL)
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds.append(time.perf_counter() - start)
    size = os.path.getsize(out)
    os.remove(out)
    return {"status": "ok", "unit": "s", "command": "tar cf + fsync", "bytes": size, **summarise(seconds)}
