"""readers._pool: a rank's DataLoader workers pool their counts through shared memory made
before they start, in real processes; a missing peer, a slot left held
and a slot of another rank are refused, each in bounded time."""
from __future__ import annotations

import multiprocessing
import pickle
import time

import pytest

from readers._pool import POSTED, CountPool


def pool_in_process(pool: CountPool, rank: int, worker_id: int, workers: int, count: int, results) -> None:
    results.put((worker_id, pool.pool(rank, worker_id, workers, count, wait_s=60)))


def test_workers_of_a_rank_pool_their_counts_through_memory_made_before_they_start():
    # forked here; spawned workers: test_elastic's test_torchdata_workers_started_by_spawn_pool_their_counts
    context = multiprocessing.get_context("fork")
    pool, results = CountPool(), context.Queue()
    counts = [7, 0, 1 << 29]
    for _ in range(2):  # a second pool of the same memory starts from empty slots
        procs = [context.Process(target=pool_in_process, args=(pool, 3, w, 3, counts[w], results)) for w in range(3)]
        for proc in procs:
            proc.start()
        got = dict(results.get(timeout=60) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
            assert proc.exitcode == 0
        assert got == {w: counts for w in range(3)}
        assert list(pool.words[:3]) == [0, 0, 0]
        counts = counts[::-1]


def test_a_peer_that_never_posts_is_refused_in_bounded_time():
    pool = CountPool()
    began = time.monotonic()
    with pytest.raises(ValueError, match="worker\\(s\\) 1 of 2 on rank 0 did not post its count within 0 s; each "
                                         "worker holds one part"):
        pool.pool(0, 0, 2, 5, wait_s=0.2)
    assert time.monotonic() - began < 5
    assert pool.words[0] == 0  # its own slot is left empty for the next pool


def test_a_slot_left_held_by_a_stopped_worker_is_refused_and_cleared():
    pool = CountPool()
    pool.words[1] = (0 + 1) << 32 | 4 << 2 | POSTED  # worker 1 of rank 0 stopped after posting
    with pytest.raises(ValueError, match="worker 1 of rank 0 found its slot .* still held: an earlier resume's "
                                         "worker was stopped mid-way.*start the loader again"):
        pool.pool(0, 1, 2, 4, wait_s=0.2)
    assert pool.words[1] == 0


def test_a_slot_of_another_rank_is_refused_saying_to_make_the_dataset_in_each_rank():
    pool = CountPool()
    pool.words[1] = (5 + 1) << 32 | 4 << 2 | POSTED
    shared = "worker 1 of rank 5 pools its saved position with rank 0's workers: one WDSDataset object is shared by " \
             "ranks.*make one in each rank"
    with pytest.raises(ValueError, match=shared):  # met while waiting for the peers
        pool.pool(0, 0, 2, 4, wait_s=5)
    assert pool.words[0] == 0
    with pytest.raises(ValueError, match=shared):  # met in its own slot: left as it is, the other rank's
        pool.pool(0, 1, 2, 4, wait_s=5)
    assert pool.words[1] == (5 + 1) << 32 | 4 << 2 | POSTED


def test_a_count_past_the_word_and_too_many_workers_are_refused():
    with pytest.raises(ValueError, match="past what workers can pool"):
        CountPool().pool(0, 0, 1, 1 << 30)
    with pytest.raises(ValueError, match="513 DataLoader workers cannot pool.*at most 512"):
        CountPool().pool(0, 0, 513, 1)


def test_a_stream_pickled_plainly_makes_its_own_pool(tmp_path):
    from conftest import class_sorted_tree
    from packer import pack
    from readers import WDSDataset

    pack(str(class_sorted_tree(tmp_path / "src", classes=2, per_class=2)), "wds", str(tmp_path / "d.wds"),
         workers=1, progress=False)
    data = WDSDataset(tmp_path / "d.wds")
    copy = pickle.loads(pickle.dumps(data))
    data.resume.pool.words[0] = 9
    assert copy.resume.pool.words[0] == 0  # shared memory does not travel by plain pickling


def sdl_stream(root, workers: int, rank: int, world_size: int, **options):
    """(a torchdata StatefulDataLoader over the WDS pack's stream, its WDSDataset)."""
    from conftest import sample_ids
    from readers import WDSDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = WDSDataset(root / "d.wds", decode="raw", shuffle=16, seed=3, rank=rank, world_size=world_size)
    return StatefulDataLoader(data, 5, num_workers=workers, collate_fn=sample_ids, **options), data


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_persistent_workers_prefetching_deep_pool_once_and_read_the_next_epoch_as_a_fresh_run(tmp_path, context):
    # 2 ranks x 2 workers stop after 3 batches each; rank 0's state resumes on 1 rank, whose 2 workers,
    # kept between epochs and 4 batches ahead each, pool their counts as they start
    from collections import Counter

    from conftest import packed_three_ways

    root = tmp_path
    packed_three_ways(root)
    options = {"multiprocessing_context": context, "prefetch_factor": 4}
    seen, states = [], []
    for rank in range(2):
        loader, data = sdl_stream(root, 2, rank, 2, **options)
        data.set_epoch(0)
        batches = iter(loader)
        seen += [sample for _ in range(3) for sample in next(batches)]
        states.append(loader.state_dict())
        del batches
    loader, data = sdl_stream(root, 2, 0, 1, persistent_workers=True, **options)
    loader.load_state_dict(states[0])
    data.set_epoch(0)
    rest = [sample for batch in loader for sample in batch]
    counts = Counter(seen + rest)
    assert len(counts) == 100 and set(counts.values()) == {1}  # every sample of the epoch once
    data.set_epoch(1)
    fresh, fresh_data = sdl_stream(root, 2, 0, 1, **options)
    fresh_data.set_epoch(1)
    assert [batch for batch in loader] == [batch for batch in fresh]
    assert list(data.resume.pool.words[:2]) == [0, 0]
