"""Time to the first batch after an elastic resume, against a fresh start, at ImageNet's 1.28M records.

`python -m benchmarks.resume [--records N] [--repeats R]` prints one JSON line per figure.

Samplers (random, block): a DataLoader (readers' EpochLoader, 2 workers, batches of 256)
over 1,281,167 in-memory records, rank 0 of 6; the resumed one first loads a state saved
on 8 ranks 60% into the epoch. Timed from building the loader to holding its first
batch, median of the repeats; the only difference is the state loaded.

Stream: what a resume adds to a fresh start is the replay of the saving passes on sample
numbers alone (readers.wds_elastic.rest), done by every worker before it reads: timed
over 1,000 shards of 1,281 samples (counts only; nothing is read), state saved on 8 ranks
x 4 workers 60% in, shuffle buffer 1,000, against a fresh start's time to the first
batch of a stream of shards written here: ImageNet JPEGs (/work/shared/data's sample,
over and over), decoded, as training reads them; without that folder, undecoded bytes.
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from readers import BlockShuffleSampler, ShuffleSampler, WDSDataset
from readers.loader import EpochLoader
from readers.wds import shuffled
from readers.wds_elastic import numbers, offsets, rest, stream_rng

IMAGENET = 1_281_167
SHARED = Path("/work/shared/data/imagenet-sample")
BATCH, WORKERS, SAVED_ON, RESUMED_ON, AT = 256, 2, 8, 6, 0.6


class Records(torch.utils.data.Dataset):
    """n records of 16 bytes, made on demand: the sampler's cost, not the storage's."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((16,), index % 251, dtype=torch.uint8)


def sampler_of(order: str, data, rank: int, world_size: int):
    if order == "random":
        return ShuffleSampler(data, seed=0, rank=rank, world_size=world_size)
    return BlockShuffleSampler(data, seed=0, rank=rank, world_size=world_size)


def saved_state(order: str, data) -> dict:
    """Rank 0's sampler state on SAVED_ON ranks, AT of the way through epoch 0."""
    sampler = sampler_of(order, data, 0, SAVED_ON)
    batches = iter(sampler)
    for _ in range(int(AT * len(sampler))):
        next(batches)
    return json.loads(json.dumps(sampler.state_dict()))


def seconds_to_first_batch(make_loader) -> float:
    """Seconds from make_loader() building the loader to its first batch."""
    began = time.perf_counter()
    batches = iter(make_loader())
    next(batches)
    took = time.perf_counter() - began
    del batches
    return took


def first_batch(order: str, data, state: dict | None) -> float:
    """Seconds from building the loader, its state loaded, to its first batch."""
    def make():
        sampler = sampler_of(order, data, 0, RESUMED_ON)
        if state is not None:
            sampler.load_state_dict(state)
        return EpochLoader(data, batch_size=BATCH, sampler=sampler, num_workers=WORKERS)

    return seconds_to_first_batch(make)


def write_shards(folder: Path, images: list[Path], shards: int = 4, per_shard: int = 256) -> list[str]:
    """A few shards for a fresh stream's first batch: the given JPEGs over and over, else
    1 KB samples of zeros."""
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                image = images[(s * per_shard + i) % len(images)].read_bytes() if images else bytes(1024)
                for suffix, data in (("jpg", image), ("cls", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"s{s}_{i:05d}.{suffix}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def stream_first_batch(paths: list[str], decode: str) -> float:
    return seconds_to_first_batch(lambda: EpochLoader(
        WDSDataset(paths, decode=decode, shuffle=1000, seed=0, rank=0, world_size=1), batch_size=BATCH,
        num_workers=WORKERS, collate_fn=len))


def counted_stream(paths: list[str], records: int, shards: int = 1000) -> WDSDataset:
    """A stream over `records` samples in `shards` shards, by count only: for working out
    orders on sample numbers, which reads nothing."""
    stream = WDSDataset(paths, decode="raw", shuffle=1000, seed=0)
    stream.shards = [paths[0]] * shards
    stream.counts = [records // shards + (s < records % shards) for s in range(shards)]
    return stream


def stream_replay(paths: list[str], records: int) -> float:
    """Seconds to work out the rest after a state saved on SAVED_ON ranks x 4 workers, AT in."""
    stream = counted_stream(paths, records)
    per_rank = -(-records // SAVED_ON)
    batches = int(AT * per_rank / BATCH)
    history = [{"world_size": SAVED_ON, "workers": 4, "batches": batches, "batch_size": BATCH, "drop_last": True}]
    began = time.perf_counter()
    left = rest(stream, history)
    took = time.perf_counter() - began
    assert sum(map(stream.task_size, left)) > 0
    return took


def global_stream_order(stream, world_size: int, workers: int) -> np.ndarray:
    """Epoch 0's sample numbers in the order the steps of a run on world_size ranks x
    workers workers consume them (drop_last: each worker's partial batch left out), worked
    out on numbers alone, through the streams' real shuffle buffers."""
    first = offsets(stream)
    ranks = []
    for rank in range(world_size):
        plan = stream.plan(rank, world_size)
        batches = []
        for worker in range(workers):
            ids = numbers(stream, stream.worker_tasks(plan, worker, workers), first).tolist()
            rng = stream_rng(stream, rank, worker)
            out = list(shuffled(ids, stream.shuffle, rng)) if rng is not None else ids
            batches.append([out[i:i + BATCH] for i in range(0, len(out) - BATCH + 1, BATCH)])
        # The DataLoader takes one batch from each worker in turn.
        ranks.append([b for turn in itertools.zip_longest(*batches) for b in turn if b is not None])
    steps = min(map(len, ranks))
    return np.array([s for step in range(steps) for r in ranks for s in r[step]], dtype=np.int64)


def stream_drift(paths: list[str], records: int, configs) -> list[dict]:
    """How far each sample's place in the epoch's global order moves from a 1 rank x 1 worker
    run's, as a share of the epoch: mean, and the share of samples moved more than 10%."""
    stream = counted_stream(paths, records)
    base = global_stream_order(stream, 1, 1)
    where = np.full(records, -1, dtype=np.int64)
    where[base] = np.arange(len(base))
    found = []
    for world_size, workers in configs:
        order = global_stream_order(stream, world_size, workers)
        order = order[where[order] >= 0]
        moved = np.abs(where[order] - np.arange(len(order))) / len(base)
        found.append({"ranks": world_size, "workers": workers, "mean_moved": round(float(moved.mean()), 4),
                      "over_10pct": round(float((moved > 0.1).mean()), 4)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=IMAGENET)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = Records(args.records)
    for order in ("random", "block"):
        state = saved_state(order, data)
        fresh = statistics.median(first_batch(order, data, None) for _ in range(args.repeats))
        resumed = statistics.median(first_batch(order, data, state) for _ in range(args.repeats))
        print(json.dumps({"order": order, "records": args.records, "fresh_s": round(fresh, 3),
                          "resumed_s": round(resumed, 3), "ratio": round(resumed / fresh, 2),
                          "state_bytes": len(json.dumps(state))}))
    images = sorted(SHARED.rglob("*.JPEG"))  # decoded, as a training stream's first batch is
    with tempfile.TemporaryDirectory() as folder:
        paths = write_shards(Path(folder), images)
        decode = "pil" if images else "raw"
        fresh = statistics.median(stream_first_batch(paths, decode) for _ in range(args.repeats))
        replay = statistics.median(stream_replay(paths, args.records) for _ in range(args.repeats))
        print(json.dumps({"order": "stream", "records": args.records, "fresh_s": round(fresh, 3),
                          "replay_s": round(replay, 3), "ratio": round((fresh + replay) / fresh, 2),
                          "first_batch": f"{len(images)} ImageNet JPEGs decoded" if images else "1 KB, undecoded"}))
        for drift in stream_drift(paths, args.records, ((1, 8), (8, 8), (6, 4))):
            print(json.dumps({"order": "stream", "drift_from": "1 rank x 1 worker", **drift}))

if __name__ == "__main__":
    main()
