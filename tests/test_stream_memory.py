"""Memory at scale of a WDSDataset's stream and its resume, in a DataLoader worker: what it
holds grows with the shards it reads, not with the pack's records."""
from __future__ import annotations

import tracemalloc

import pytest
import torch.utils.data

from readers import WDSDataset
from readers.wds_elastic import rank_plan

SHARD = 2_000  # samples a shard: the packs differ in records and shards, not in shard size
SIZES = (4_000, 100_000)
PER_SHARD = 1024  # bytes a shard may add: what a table of half a byte a record would
# A pass on 3 ranks of 2 workers that handed out 10 batches of 64 per rank, its streams
# stopped inside their shuffle buffers: what a state saved there resumes after.
HISTORY = [{"world_size": 3, "workers": 2, "batches": 10, "batch_size": 64, "drop_last": False}]


class Traced(torch.utils.data.IterableDataset):
    """In a DataLoader worker, a WDSDataset streamed whole (or, with history, its rank 0 of 2's
    plan after that history worked out), its allocations traced: yields (samples or tasks,
    the bytes Python and numpy held at the end and the most they held at once, beyond what
    they held before)."""

    def __init__(self, path: str, history: list[dict] | None = None):
        self.stream = WDSDataset(path, decode="raw", shuffle=50, seed=1)
        self.history = history

    def __iter__(self):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        if self.history is None:
            found = sum(1 for _ in self.stream)
        else:
            found = len(rank_plan(self.stream, 0, 2, self.history))
        kept, peak = tracemalloc.get_traced_memory()
        yield found, kept - before, peak - before
        tracemalloc.stop()


def in_worker(dataset: Traced) -> tuple[int, int, int]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
    return next(iter(loader))


@pytest.fixture(scope="module")
def tiny_packs(tmp_path_factory) -> dict[int, str]:
    from benchmarks import tiny

    folder = tmp_path_factory.mktemp("tiny")
    packs = {}
    for records in SIZES:
        packs[records] = str(folder / f"tiny-{records}.wds")
        tiny.write_tiny_pack(packs[records], records, fmt="wds", options={"max_count": SHARD})
    return packs


def check_per_shard(found: dict[int, tuple[int, int]]) -> None:
    """Raise unless what the worker kept and its peak grew by under PER_SHARD a shard more."""
    shards = (SIZES[1] - SIZES[0]) // SHARD
    for what, k in (("kept", 0), ("peak", 1)):
        grown = found[SIZES[1]][k] - found[SIZES[0]][k]
        assert grown < shards * PER_SHARD, f"the worker's {what} grew by {grown} bytes for {shards} shards: {found}"


def test_a_wds_stream_holds_nothing_per_record_in_a_worker(tiny_packs):
    # The worker reads its index a shard's records at a time from the mapped records.bin
    # (order.bin where the pack has one; a pack written unshuffled is in index order): the
    # path table is not loaded (its offsets: 4 bytes a record), nor records.bin's storage
    # order sorted (4 bytes a record kept, 12 while sorting). What grows is per shard: its
    # name and counts in the plan and the index.
    found = {}
    for records, path in tiny_packs.items():
        samples, *found[records] = in_worker(Traced(path))
        assert samples == records
    check_per_shard(found)


def test_a_wds_resume_on_other_ranks_holds_nothing_per_record_in_a_worker(tiny_packs):
    # What the history's streams yielded is worked out as runs of samples, less those still
    # in each stream's shuffle buffer (50 here): not a mark per sample of the epoch (1 byte
    # a record) nor its sample numbers (8).
    found = {}
    for records, path in tiny_packs.items():
        tasks, *found[records] = in_worker(Traced(path, HISTORY))
        assert tasks
    check_per_shard(found)


def test_the_shard_list_study_lists_laions_layout_without_writing_its_shards(tmp_path):
    from benchmarks import tiny

    out = tiny.laion_index(str(tmp_path / "laion.wds"), shards=300, per_shard=10_000)
    stream = WDSDataset(out, shuffle=1000)
    assert len(stream) == 3_000_000 and len(stream.epoch_tasks()) == 300
    assert len(list((tmp_path / "laion.wds" / "train").glob("*.tar"))) == 1
    plan = rank_plan(stream, 0, 8, HISTORY)
    assert 0 < sum(map(stream.task_size, plan)) < 3_000_000 // 8 + 1
    figures = {"s": 1.0, "tasks": 5, "kept_mb": 1.0, "peak_mb": 2.0}
    shards = {"shards": 300, "per_shard": 10_000, "world_size": 8, "dataset_mb": 1.0, "dataset_bytes_per_shard": 3.0,
              "plan_1_rank": figures}
    row = {key: 1.0 for key in (*tiny.SCALARS, "pack_rate")} | {
        "records": 10, "main": {"uss_mb": 10.0}, "workers": [{"uss_mb": 10.0, "private_dirty_mb": 9.0}]}
    page = tiny.markdown({"rows": [row], "shard_list": shards})
    assert "Shard list at 300 shards of 10,000 samples" in page and "| plan 1 rank | 1.00 | 5 | 1.0 | 2.0 |" in page
