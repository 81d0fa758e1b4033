"""A WebDataset stream resumed on other ranks and workers hands out exactly the samples its
saved passes did not (readers.wds_elastic.rest): checked on random states against the
records each pass's streams really read (their tasks through their shuffle buffers); the
one-sample runs it reads first, a shard's in one pass, fail and warn as runs read alone."""
from __future__ import annotations

import os
import random
import warnings
from collections import Counter

import pytest

from packer.errors import CorruptDataError
from readers import WDSDataset
from readers._stream import Task, consumed_samples, stream_sizes
from readers._wds_shuffle import samples_after, stream_rng
from readers.wds_elastic import rank_plan

PACKS = ((257, 23), (100, 7))  # (records, samples a shard): the last shard of each is shorter


@pytest.fixture(scope="module")
def tiny_packs(tmp_path_factory) -> list[str]:
    from benchmarks import tiny

    folder = tmp_path_factory.mktemp("rest")
    packs = []
    for records, per_shard in PACKS:
        packs.append(str(folder / f"tiny-{records}.wds"))
        tiny.write_tiny_pack(packs[-1], records, fmt="wds", options={"max_count": per_shard})
    return packs


def stream(ds: WDSDataset, history: list[dict], rank: int, world_size: int, worker: int, workers: int) -> list[int]:
    """The records (tiny packs hold each one's number) that a worker's stream of a pass after
    `history` yields, in order: its tasks of the rank's plan, read through its shuffle buffer."""
    tasks = ds.worker_tasks(rank_plan(ds, rank, world_size, history), worker, workers)
    rng = stream_rng(ds.shuffle, ds.seed, ds.epoch, rank, worker)
    return [int.from_bytes(data, "little") for _, data, _ in samples_after(ds, tasks, 0, rng)]


def plan_length(ds: WDSDataset, history: list[dict], world_size: int) -> int:
    """The samples of each rank's plan in a pass after history (every rank's is as long)."""
    return sum(map(ds.task_size, rank_plan(ds, 0, world_size, history)))


def random_pass(ds: WDSDataset, history: list[dict], rng: random.Random) -> tuple[dict, list[int]]:
    """A pass after `history` on random ranks and workers, stopped at random as a loader's
    state (its batches), a StatefulDataLoader worker's (each stream's count) or a stream
    mixture's (each rank's counts) records it: (its segment, the records its streams yielded)."""
    world_size, workers = rng.randint(1, 5), rng.randint(1, 4)
    sizes = stream_sizes(plan_length(ds, history, world_size), workers)
    kind = rng.choice(("batches", "streams", "ranks"))
    if kind == "batches":
        batch_size, drop_last = rng.choice((1, 3, 8)), rng.random() < 0.5
        batches = rng.randint(0, sum(n // batch_size + (not drop_last and n % batch_size > 0) for n in sizes))
        segment = {"world_size": world_size, "workers": workers, "batches": batches, "batch_size": batch_size,
                   "drop_last": drop_last}
        counts = [consumed_samples(sizes, batches, batch_size, drop_last)[0]] * world_size
    elif kind == "streams":  # every rank's streams had yielded as many (equal shares, equal batches)
        counts = [[rng.randint(0, n) for n in sizes]] * world_size
        segment = {"world_size": world_size, "workers": workers, "streams": counts[0]}
    else:
        counts = [[rng.randint(0, n) for n in sizes] for _ in range(world_size)]
        segment = {"world_size": world_size, "workers": workers, "ranks": counts}
    yielded = [record for rank in range(world_size) for worker in range(workers)
               for record in stream(ds, history, rank, world_size, worker, workers)[:counts[rank][worker]]]
    return segment, yielded


@pytest.mark.parametrize("seed", range(4))
def test_a_pass_after_random_passes_hands_out_exactly_the_records_they_did_not(tiny_packs, seed):
    rng = random.Random(seed)
    for _ in range(6):
        pack = rng.randrange(len(PACKS))
        records = PACKS[pack][0]
        ds = WDSDataset(tiny_packs[pack], decode="raw", shuffle=rng.choice((0, 1, 2, 7, 40)), seed=rng.randrange(100))
        ds.set_epoch(rng.randrange(3))
        history, handed = [], []
        for _ in range(rng.randint(1, 3)):
            segment, yielded = random_pass(ds, history, rng)
            history.append(segment)
            handed += yielded
        world_size, workers = rng.randint(1, 5), rng.randint(1, 4)
        after = [record for rank in range(world_size) for worker in range(workers)
                 for record in stream(ds, history, rank, world_size, worker, workers)]
        # Every record once in the epoch: the passes' own and the last's, less the padding
        # each pass adds (at most world size - 1 repeats of its first records).
        assert set(handed) | set(after) == set(range(records))
        assert not set(handed) & set(after)
        repeats = sum(n - 1 for n in Counter(after).values())
        assert repeats <= world_size - 1
        assert len(after) == world_size * plan_length(ds, history, world_size)


def read_all(ds: WDSDataset, groups: list[list]) -> tuple[list, list[str], str | None]:
    """(records read, warnings, the error that stopped the read or None) of read_tasks over
    each group of tasks."""
    from readers._wds_read import read_tasks

    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for group in groups:
                for _, data, _ in read_tasks(ds, group):
                    got.append(int.from_bytes(data, "little"))
        except CorruptDataError as exc:
            return got, [str(w.message) for w in caught], str(exc)
    return got, [str(w.message) for w in caught], None


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_shards_runs_read_in_one_pass_fail_and_warn_as_read_one_by_one(tmp_path, on_error):
    """A resumed pass's one-sample runs of a shard are read together: a damaged sample among
    them stops the stream, or is left out and warned of, as when each run is read alone."""
    from benchmarks import tiny
    from packer.formats import wds

    out = str(tmp_path / "tiny.wds")
    tiny.write_tiny_pack(out, 60, fmt="wds", options={"max_count": 30})
    reader = wds.Reader(out)
    offset = int(reader.records["offset"][7])  # record 7, the 8th of the first shard (unshuffled)
    shard = os.path.join(out, reader.shards[0])
    reader.close()
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff")
    tasks = [Task(0, k, k + 1) for k in (2, 5, 7, 9)] + [Task(0, 11, 20), Task(1, 3, 4), Task(1, 8, 9)]
    ds = WDSDataset(out, decode="raw", on_error=on_error)
    together = read_all(ds, [tasks])
    assert together == read_all(WDSDataset(out, decode="raw", on_error=on_error), [[task] for task in tasks])
    records, caught, error = together
    assert 7 not in records and records[:2] == [2, 5]
    if on_error == "fail":
        assert records == [2, 5] and "checksum mismatch" in error
    else:
        assert error is None and len(records) == 3 + 9 + 2 and len(caught) == 1 and "checksum mismatch" in caught[0]


# 9,000 and 19,000 draws (the last past the input's end: the buffer shuffled after), 4,990 of
# a 3-bit draw, and 500 (drawn in Python).
@pytest.mark.parametrize("n, size, skip", [(20_000, 1000, 9_000), (20_000, 1000, 19_500), (5_000, 7, 4_990),
                                           (900, 100, 500)])
def test_a_replayed_shuffle_buffer_goes_on_as_the_stream_it_replays(n, size, skip):
    """Replaying a stream's draws on ordinals (thousands of them by numpy's MT19937, a few in
    Python) leaves the buffer and the generator where the stream itself is: resumed from
    there, it yields the rest of the stream."""
    from readers._stream import replay_shuffle
    from readers._wds_shuffle import resumed_shuffle, shuffled

    whole = list(shuffled(iter(range(n)), size, stream_rng(size, 0, 1, 2, 3)))
    rng = stream_rng(size, 0, 1, 2, 3)
    slots, consumed, drained = replay_shuffle(n, size, rng, skip)
    source = ((k, k) for k in sorted(set(slots) | set(range(consumed, n))))
    assert list(resumed_shuffle(source, slots, drained, size, rng)) == whole[skip:]
