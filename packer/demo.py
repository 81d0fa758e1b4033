"""The demo's read-back step: the one place packer reaches into readers (and so torch),
because the demo's job is to show the whole path a training job takes."""
from __future__ import annotations

import time

import numpy as np


def samples_per_s(dataset, seconds: float = 2.0) -> float:
    order = np.random.default_rng(0).permutation(len(dataset))
    dataset[int(order[0])]  # open the handle outside the timed loop
    start = time.perf_counter()
    n = 0
    for i in order:
        dataset[int(i)]
        n += 1
        if time.perf_counter() - start > seconds:
            break
    return n / (time.perf_counter() - start)


def read_rates(src: str, packed: str) -> list[tuple[str, float]]:
    """Random-order samples/s of the raw folder and of the packed dataset, decoding to tensors."""
    import readers

    packed_dataset = readers.open_dataset(packed, decode="tensor")
    return [("FolderDataset", samples_per_s(readers.FolderDataset(src, decode="tensor"))),
            (type(packed_dataset).__name__, samples_per_s(packed_dataset))]
