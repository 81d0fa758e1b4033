"""Times `packer.pack` per format against `tar cf` of the same folder: the cost of moving the bytes.

Before every run the source is evicted from the page cache (cold, the default: a dataset
being packed is rarely in RAM, and it is how the target in the issues was measured) or
read into it (warm: the CPU cost alone), so each writer and tar start from the same
state; tar's archive is fsynced as packer's writers fsync their output. The previous
run's output is deleted and every dirty page flushed before the clock starts, so no run
pays for the one before it (replacing a 2 GB output with --force is the pack's own
business, not the writer's speed).
"""
from __future__ import annotations

import math
import os
import subprocess
import time

from packer.output import remove_path

from . import cache
from .case import summarise

MIN_SHARD = 16 << 20  # tiny shards would measure tar-member overhead instead


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in cache.data_files(path))


def pack_options(fmt: str, corpus_bytes: int, workers: int) -> dict:
    """Options for packer.pack: for wds, shards small enough that every loader worker gets some.

    WDSDataset gives each DataLoader worker its own run of a rank's samples; in fewer shards
    than workers, runs share shards, and the figures measure the shard count, not the format.
    """
    if fmt != "wds":
        return {}
    return {"shard_size": max(MIN_SHARD, math.ceil(corpus_bytes / (2 * max(1, workers))))}


def prepare_run(files: list[str], state: str, out: str) -> None:
    """Remove out, flush what earlier runs left dirty, then evict (cold) or load (warm) the source."""
    remove_path(out)
    os.sync()
    (cache.evict if state == "cold" else cache.load)(files)


def time_pack(folder: str, fmt: str, out: str, workers: int, repeat: int, options: dict | None = None,
              state: str = "cold") -> dict:
    """Pack folder into out `repeat` times (the last one stays for the read cases)."""
    import packer

    files = cache.data_files(folder)
    seconds = []
    for _ in range(repeat):
        prepare_run(files, state, out)
        start = time.perf_counter()
        packer.pack(folder, fmt, out, workers=workers, force=True, progress=False, options=options)
        seconds.append(time.perf_counter() - start)
    written = cache.data_files(out)
    return {"status": "ok", "unit": "s", "workers": workers, "options": options or {}, "cache": state,
            "bytes": sum(os.path.getsize(p) for p in written),
            "shards": sum(p.endswith(".tar") for p in written), **summarise(seconds)}


def time_tar(folder: str, out: str, repeat: int, state: str = "cold") -> dict:
    folder = os.path.abspath(folder)
    files = cache.data_files(folder)
    seconds = []
    for _ in range(repeat):
        prepare_run(files, state, out)
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
    return {"status": "ok", "unit": "s", "command": "tar cf + fsync", "cache": state, "bytes": size, **summarise(seconds)}
