"""The demo's read-back step: the one place packer reaches into readers (and so torch),
because the demo's job is to show the whole path a training job takes.

It shows both regimes a training job meets: raw random reads from a cold page cache,
where the disk is the limit and packing wins, and decoding from a warm cache, where the
CPU is the limit and every source runs at the decoder's rate.
"""
from __future__ import annotations

import os
import time
from typing import NamedTuple

import numpy as np

from .formats import CAN_ADVISE, evict



class Comparison(NamedTuple):
    what: str
    unit: str
    rates: list[tuple[str, float]]  # (Dataset class name, per second), folder first


def evict_folder(folder: str) -> None:
    """Drop every file under folder from the page cache."""
    evict(os.path.join(root, name) for root, _, files in os.walk(folder) for name in files)


def rate(dataset, order, seconds: float) -> float:
    """Items of dataset read per second, in `order`, for at most `seconds` (one pass at most)."""
    start = time.perf_counter()
    n = 0
    for i in order:
        dataset[int(i)]
        n += 1
        if time.perf_counter() - start > seconds:
            break
    return n / (time.perf_counter() - start)


def cold_raw_rate(dataset, folder: str, seconds: float = 2.0) -> float:
    """Raw records/s in make_loader's random order (readers.ShuffleSampler), page cache cold."""
    import readers  # here, not at the top: readers needs torch, and the rest of packer runs without it

    if hasattr(dataset.reader, "advise"):  # as make_loader does for random order: read exactly each record
        dataset.reader.advise("random")
    dataset.reader.open()  # the handle and tables, outside the timed loop
    evict_folder(folder)
    # Iterated while reading: the sampler hints the records ahead of the one being read.
    return rate(dataset, readers.ShuffleSampler(dataset, seed=0), seconds)


def warm_decode_rate(dataset, seconds: float = 2.0) -> float:
    order = np.random.default_rng(0).permutation(len(dataset))
    for i in order:  # read everything once: warm
        dataset.reader.read_image(int(i))
    return rate(dataset, order, seconds)


def read_rates(src: str, packed: str) -> list[Comparison]:
    """The folder against the packed dataset: cold raw reads (where supported) and warm decodes."""
    import readers  # here, not at the top: readers needs torch, and the rest of packer runs without it

    def pair(**options) -> list:
        return [readers.FolderDataset(src, **options), readers.open_dataset(packed, **options)]

    comparisons = []
    if CAN_ADVISE:  # eviction is posix_fadvise advice
        cold = [cold_raw_rate(ds, folder) for ds, folder in zip(pair(decode="raw"), (src, packed))]
        comparisons.append(Comparison("cold cache, raw bytes", "records/s", named(pair(), cold)))
    warm = [warm_decode_rate(ds) for ds in pair(decode="tensor")]
    comparisons.append(Comparison("warm cache, decoded", "samples/s", named(pair(), warm)))
    return comparisons


def named(datasets: list, rates: list[float]) -> list[tuple[str, float]]:
    return [(type(ds).__name__, r) for ds, r in zip(datasets, rates)]
