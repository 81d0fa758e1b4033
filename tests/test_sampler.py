"""ShuffleSampler and BlockShuffleSampler: coverage, locality, DDP shares, storage order,
read-ahead hints, mixing."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch.utils.data as tud

import readers
from benchmarks import cache
from packer import pack
from packer.formats import _io
from readers import BlockShuffleSampler, ShuffleSampler, class_entropy, make_loader
from readers import sampler as sampler_module

from conftest import class_sorted_tree


class Sized:
    """A plain map-style dataset of n items: no reader, so storage order is index order."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


@pytest.fixture
def sorted_tree(tmp_path):
    return class_sorted_tree(tmp_path / "src", classes=4, per_class=10)


@pytest.mark.parametrize("n", [0, 1, 23, 1000])
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffle_sampler_deals_one_permutation_in_distributed_sampler_shares(n, world, drop_last):
    for epoch in (0, 5):
        whole = ShuffleSampler(Sized(n), seed=7, rank=0, world_size=1)
        whole.set_epoch(epoch)
        order = list(whole)
        assert sorted(order) == list(range(n))
        theirs = tud.DistributedSampler(Sized(n), num_replicas=world, rank=0, seed=7, drop_last=drop_last)
        padded = (order + order * world)[:len(theirs) * world]  # DistributedSampler's padding or cut
        for rank in range(world):
            ours = ShuffleSampler(Sized(n), seed=7, rank=rank, world_size=world, drop_last=drop_last)
            ours.set_epoch(epoch)
            assert list(ours) == padded[rank::world] and len(ours) == len(theirs)
    assert list(ShuffleSampler(Sized(9), shuffle=False)) == list(range(9))
    with pytest.raises(ValueError, match="ShuffleSampler: pass rank and world_size together"):
        ShuffleSampler(Sized(10), world_size=2)
    with pytest.raises(ValueError, match="ahead must be an int >= 0"):
        ShuffleSampler(Sized(10), ahead=-1)


def hinted_sampler(tmp_path, tree, fmt: str, monkeypatch):
    """(dataset, a ShuffleSampler over it, the indexes it hints, its data files); hints are
    recorded and still sent."""
    out = tmp_path / f"r.{fmt}"
    pack(str(tree), fmt, str(out), progress=False, workers=1)
    dataset = readers.open_dataset(out, decode="raw").open()
    reader, hinted = dataset.reader, []
    send = reader.will_need_records

    def record(indexes):
        hinted.extend(indexes.tolist())
        return send(indexes)

    monkeypatch.setattr(reader, "will_need_records", record)
    files = [p for p in cache.data_files(str(out)) if p.endswith((".mdb", ".tar")) or p == str(out)]
    return dataset, ShuffleSampler(dataset, seed=1), hinted, files


needs_page_cache_control = pytest.mark.skipif(
    not cache.CAN_EVICT or cache.resident_fraction([__file__]) is None or not _io.CAN_PROBE,
    reason="needs posix_fadvise, mincore and RWF_NOWAIT")


def record_pages(dataset, indexes=None) -> dict[str, np.ndarray]:
    """The page numbers, by file, that hold the bytes of the dataset's records (all, or those
    of indexes)."""
    pages: dict[str, set] = {}
    indexes = np.arange(len(dataset)) if indexes is None else indexes
    for fd, offset, length in dataset.reader.record_extents(indexes):
        pages.setdefault(os.readlink(f"/proc/self/fd/{fd}"), set()).update(
            range(offset // cache.PAGE, (offset + length - 1) // cache.PAGE + 1))
    return {path: np.fromiter(found, dtype=np.int64) for path, found in pages.items()}


def evict_settled(files) -> None:
    """Evict files once every read of them in flight has landed: a read waits for those."""
    cache.load(files)
    cache.evict(files)


def evicted(files, dataset) -> None:
    """Evict files from the page cache. The hint tests count on the records reading cold.

    Reads may still be in flight: hints just sent, or the kernel's read-ahead after the
    pack was opened (read_ahead_kb can exceed a small pack, so one read brings in all of
    it). DONTNEED skips pages being read and mincore does not count them, so they would
    land after the check and the records would read warm; reading the files through
    first waits for every such read. One eviction can still leave pages behind (pages on
    another CPU's lists), so it is repeated until no more of the records' pages go: to
    none, or to those this process has mapped (LMDB reads its tables through its map,
    and touches each record's first page there when it builds its extents)."""
    pages = record_pages(dataset)
    total, previous = sum(len(p) for p in pages.values()), None
    for _ in range(10):
        evict_settled(files)
        left = sum(int(cache.resident_map(path)[p].sum()) for path, p in pages.items()) / total
        if left < 0.01 or left == previous:
            break
        previous = left
        time.sleep(0.1)
    if left > 0.5:
        pytest.skip(f"{left:.0%} of the records' pages stayed in the page cache after eviction (tmpfs?)")


@needs_page_cache_control
def test_eviction_outlasts_reads_in_flight(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(32 << 20))  # read-ahead is still reading it when the eviction runs
    for _ in range(3):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        os.close(fd)
        evict_settled([str(path)])
        time.sleep(0.3)  # pages the eviction missed would have landed by now
        assert cache.resident_pages(str(path))[0] == 0


@needs_page_cache_control
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_random_order_is_hinted_ahead_of_reading(tmp_path, fmt, monkeypatch):
    tree = class_sorted_tree(tmp_path / "src", classes=4, per_class=50)
    dataset, sampler, hinted, files = hinted_sampler(tmp_path, tree, fmt, monkeypatch)
    evicted(files, dataset)
    indexes, order = np.concatenate(list(sampler.index_chunks())).tolist(), []
    for i in sampler:
        order.append(i)
        # Hints go out in reading order, up to AHEAD records past the one being read.
        assert hinted == indexes[:len(hinted)]
        assert len(hinted) >= min(len(order) - 1 + sampler_module.AHEAD, 200)
    assert sorted(order) == list(range(200)) and order == indexes
    evicted(files, dataset)
    hinted.clear()
    shallow = ShuffleSampler(dataset, seed=1, ahead=16)
    next(iter(shallow))  # hints the first 16, then the 16 after them
    assert hinted == next(shallow.index_chunks())[:32].tolist()
    dataset.close()


@needs_page_cache_control
def test_hints_back_off_while_records_are_cached(tmp_path, monkeypatch):
    tree = class_sorted_tree(tmp_path / "src", classes=4, per_class=250)
    dataset, sampler, hinted, files = hinted_sampler(tmp_path, tree, "hdf5", monkeypatch)
    cache.load(files)  # warm: every record is cached
    assert sorted(sampler) == list(range(1000))
    # 63 calls' worth of records: after each call that finds all cached, 1, 2, 4 ... are skipped.
    assert 3 <= sampler.read_ahead.calls <= 7 and len(hinted) == sampler.read_ahead.calls * 16
    evicted(files, dataset)
    hinted.clear()
    assert sorted(sampler) == list(range(1000))
    assert sampler.read_ahead.calls == 63 and sorted(hinted) == list(range(1000))
    dataset.close()


def test_a_state_saved_between_any_two_indexes_resumes_exactly(tmp_path):
    """Indexes go out a run at a time (a chunk, a window's part of one, a hint's records and
    those of the hints skipped with it); a state counts every index handed out, inside a run too."""
    tree = class_sorted_tree(tmp_path / "src", classes=4, per_class=150)
    pack(str(tree), "hdf5", str(tmp_path / "r.h5"), progress=False, workers=1)
    dataset = readers.open_dataset(tmp_path / "r.h5", decode="raw").open()
    for make in (lambda: ShuffleSampler(dataset, seed=2), lambda: ShuffleSampler(Sized(5000), seed=2),
                 lambda: BlockShuffleSampler(Sized(5000), block_size=10, window=4, seed=2)):
        whole = list(make())
        for taken in [k for k in (1, 15, 16, 17, 100, 599, 4097) if k < len(whole)]:
            sampler = make()
            indexes = iter(sampler)
            assert [next(indexes) for _ in range(taken)] == whole[:taken]
            state = sampler.state_dict()
            assert state["position"] == taken
            resumed = make()
            resumed.load_state_dict(state)
            assert list(resumed) == whole[taken:]
    dataset.close()


@needs_page_cache_control
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_hints_bring_the_next_records_into_the_page_cache(sorted_tree, tmp_path, fmt):
    out = tmp_path / f"c.{fmt}"
    pack(str(sorted_tree), fmt, str(out), progress=False, workers=1)
    dataset = readers.open_dataset(out, decode="raw").open()
    files = [p for p in cache.data_files(str(out)) if p.endswith((".mdb", ".tar")) or p == str(out)]
    evicted(files, dataset)
    # The pages that hold the records' bytes (the files also hold tables, headers, padding).
    pages = {(path, int(page)) for path, found in record_pages(dataset, np.arange(40)).items() for page in found}
    assert len(pages) > 40 and {path for path, _ in pages} == set(files)
    first = next(iter(ShuffleSampler(dataset, seed=0)))  # hints the first AHEAD records: all 40 here
    assert 0 <= first < 40

    def resident() -> int:
        maps = {p: cache.resident_map(p) for p in files}
        return sum(bool(maps[path][page]) for path, page in pages)

    # Nearly all: a record whose middle page came in with a neighbour counts as cached.
    deadline = time.monotonic() + 10
    while resident() < 0.9 * len(pages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident() >= 0.9 * len(pages)
    dataset.close()


def test_make_loader_shuffles_packed_data_with_the_read_ahead_sampler(sorted_tree, tmp_path, monkeypatch):
    out = tmp_path / "l.lmdb"
    pack(str(sorted_tree), "lmdb", str(out), progress=False, workers=1)
    dataset = readers.LMDBDataset(out, decode="raw", transform=len)
    loader = make_loader(dataset, 4, workers=0, seed=3)
    assert isinstance(loader.sampler, ShuffleSampler) and dataset.reader.access == "random"
    first = [int(n) for sizes, _ in loader for n in sizes]
    assert sorted(first) == sorted(os.path.getsize(sorted_tree / p) for p in dataset.paths)
    assert [int(n) for sizes, _ in loader for n in sizes] != first  # the next epoch reshuffles
    evaluation = make_loader(dataset, 4, workers=0, train=False).sampler  # index order, and a state to resume
    assert not evaluation.shuffle and list(evaluation) == list(range(len(dataset)))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = make_loader(dataset, 4, workers=0, seed=3).sampler
    assert isinstance(sampler, ShuffleSampler) and sampler.world() == (1, 3) and sampler.drop_last
    assert len(sampler) == 13 and len(set(sampler)) == 13


def test_one_rank_reads_every_index_once_in_shuffled_blocks():
    sampler = BlockShuffleSampler(Sized(1000), block_size=10, window=4, seed=3)
    first = list(sampler)
    assert len(sampler) == 1000 and sorted(first) == list(range(1000))
    assert first != list(range(1000))
    # Each window of 4 blocks (40 records) comes from 4 blocks of 10 consecutive indexes.
    for w in range(0, 1000, 40):
        assert len({i // 10 for i in first[w:w + 40]}) == 4
    assert list(sampler) == first  # same epoch, same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(1000)) and second != first


def test_without_shuffle_it_is_storage_order():
    assert list(BlockShuffleSampler(Sized(25), block_size=4, shuffle=False)) == list(range(25))


@pytest.mark.parametrize("n, world", [(1000, 3), (1000, 4), (97, 5), (3, 4)])
def test_ranks_take_one_global_block_order_by_position_with_equal_shares(n, world):
    whole = list(BlockShuffleSampler(Sized(n), block_size=8, window=2, seed=1))
    samplers = [BlockShuffleSampler(Sized(n), block_size=8, window=2, seed=1, rank=r, world_size=world)
                for r in range(world)]
    shares = [list(s) for s in samplers]
    assert len({len(s) for s in shares}) == 1 and all(len(s) == len(x) for s, x in zip(samplers, shares))
    # Step by step the ranks together read one rank's order: any world size, the same global order.
    dealt = [index for step in zip(*shares) for index in step]
    assert dealt[:n] == whole and len(dealt) - n < world  # then at most world - 1 padded repeats
    assert set(dealt[n:]) <= set(whole[:world])


def test_rank_and_world_size_are_checked():
    with pytest.raises(ValueError, match="rank and world_size together"):
        BlockShuffleSampler(Sized(10), rank=1)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockShuffleSampler(Sized(10), block_size=0)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_blocks_follow_storage_order_of_a_shuffled_pack(sorted_tree, tmp_path, fmt):
    out = tmp_path / f"s.{fmt}"
    pack(str(sorted_tree), fmt, str(out), shuffle=True, shuffle_seed=2, progress=False, workers=1)
    dataset = readers.open_dataset(out, decode="raw")
    reader = dataset.reader
    stored = reader.storage_order()
    position = np.argsort(stored)
    sampler = BlockShuffleSampler(dataset, block_size=5, window=2, seed=0)
    indexes = list(sampler)
    assert sorted(indexes) == list(range(40))
    for w in range(0, 40, 10):  # each window reads two runs of 5 consecutive stored records
        assert len({int(position[i]) // 5 for i in indexes[w:w + 10]}) == 2
    dataset.close()


def block_hints(sorted_tree, tmp_path) -> tuple:
    """(an LMDB Dataset of the 40 sorted records, a BlockShuffleSampler over it in blocks of 5
    and windows of 2, the (start, stop) spans its reader is asked to hint, in order)."""
    out = tmp_path / "d.lmdb"
    pack(str(sorted_tree), "lmdb", str(out), progress=False, workers=1)
    dataset = readers.LMDBDataset(out, decode="raw")
    hinted = []
    dataset.reader.will_need = lambda start, stop: hinted.append((start, stop))
    return dataset, BlockShuffleSampler(dataset, block_size=5, window=2, seed=0), hinted


def test_each_window_is_hinted_before_it_is_read(sorted_tree, tmp_path):
    dataset, sampler, hinted = block_hints(sorted_tree, tmp_path)
    seen = []
    for k, i in enumerate(sampler):
        seen.append(i)
        # Before window w is read, its blocks and the next window's have been hinted.
        window = k // 10
        ahead = {b for b in hinted}
        for j in seen[window * 10:]:
            assert any(a <= j < b for a, b in ahead)
        assert len(hinted) == min(2 * (window + 2), 8)
    assert sorted(hinted) == [(s, s + 5) for s in range(0, 40, 5)]
    dataset.close()


def test_set_epoch_hints_the_first_windows_and_the_pass_does_not_hint_them_again(sorted_tree, tmp_path):
    dataset, sampler, hinted = block_hints(sorted_tree, tmp_path)
    for epoch in (1, 2):
        hinted.clear()
        sampler.set_epoch(epoch)
        assert len(hinted) == 4  # the first two windows, before the loader draws an index
        first = set(hinted)
        for i in sampler:
            assert any(a <= i < b for a, b in hinted)  # hinted before it is read
        assert sorted(hinted) == [(s, s + 5) for s in range(0, 40, 5)]  # each block once a pass
        assert set(hinted[:4]) == first
    hinted.clear()
    list(sampler)  # a second pass of epoch 2, with no set_epoch before it: hinted as it goes
    assert sorted(hinted) == [(s, s + 5) for s in range(0, 40, 5)]
    dataset.close()


@pytest.mark.skipif(not cache.CAN_EVICT or cache.resident_fraction([__file__]) is None,
                    reason="needs posix_fadvise and mincore")
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_will_need_brings_the_records_into_the_page_cache(sorted_tree, tmp_path, fmt):
    out = tmp_path / f"h.{fmt}"
    pack(str(sorted_tree), fmt, str(out), progress=False, workers=1)
    reader = readers.open_dataset(out, decode="raw").reader
    reader.labels, reader.paths  # the tables, read before eviction
    if fmt == "wds":
        reader.records
    files = [p for p in cache.data_files(str(out)) if p.endswith((".mdb", ".tar")) or p == str(out)]
    cache.evict(files)
    if cache.resident_fraction(files) > 0.2:
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    reader.will_need(0, len(reader))
    deadline = time.monotonic() + 10
    while cache.resident_fraction(files) < 0.8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.resident_fraction(files) >= 0.8
    reader.close()


@pytest.mark.skipif(not (_io.CAN_ADVISE and _io.CAN_PROBE and cache.CAN_EVICT), reason="needs posix_fadvise, "
                    "RWF_NOWAIT reads and eviction (Linux)")
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_a_block_found_in_the_page_cache_is_not_hinted_again(sorted_tree, tmp_path, fmt, monkeypatch):
    out = tmp_path / f"h.{fmt}"
    pack(str(sorted_tree), fmt, str(out), progress=False, workers=1)
    dataset = readers.open_dataset(out, decode="raw").open()
    reader, advised = dataset.reader, []
    advise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: (advised.append(args[3]), advise(*args))[1])
    files = [p for p in cache.data_files(str(out)) if p.endswith((".mdb", ".tar")) or p == str(out)]
    for i in range(len(dataset)):
        dataset[i]  # every record read: its pages cached
    if cache.resident_fraction(files) < 0.9:
        pytest.skip("this file system does not keep what was read in the page cache")
    reader.will_need(0, len(reader))
    assert os.POSIX_FADV_WILLNEED not in advised  # a few probes instead of a walk of every page
    cache.evict(files)
    if cache.resident_fraction(files) > 0.2:
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    reader.will_need(0, len(reader))
    assert os.POSIX_FADV_WILLNEED in advised
    dataset.close()


def test_class_entropy_measures_mixing():
    labels = np.repeat(np.arange(4), 16)  # class-sorted storage, 4 classes of 16
    assert class_entropy(labels, range(64), 8) == 0.0  # sequential: one class per batch
    assert class_entropy(labels, np.arange(64).reshape(4, 16).T.ravel(), 4) == pytest.approx(2.0)
    rng = np.random.default_rng(0)
    shuffled = np.mean([class_entropy(labels, rng.permutation(64), 16) for _ in range(20)])
    blocks = BlockShuffleSampler(Sized(64), block_size=4, window=2, seed=0)
    assert 0 < class_entropy(labels, list(blocks), 16) < shuffled <= 2.0
    with pytest.raises(ValueError, match="fewer than one batch"):
        class_entropy(labels, range(3), 4)


@pytest.mark.parametrize("order", ["block", "sequential"])
def test_make_loader_walks_a_packed_dataset_in_blocks(sorted_tree, tmp_path, order):
    out = tmp_path / "m.h5"
    pack(str(sorted_tree), "hdf5", str(out), progress=False, workers=1)
    dataset = readers.HDF5Dataset(out, decode="raw", transform=lambda b: len(b))
    loader = make_loader(dataset, 8, workers=2, order=order, block_size=5, window=2, train=order == "block")
    assert isinstance(loader.sampler, BlockShuffleSampler)
    assert dataset.reader.access == "sequential"
    seen = [(int(n), int(label)) for sizes, labels in loader for n, label in zip(sizes, labels)]
    expected = sorted((os.path.getsize(sorted_tree / p), int(lab)) for p, lab in zip(dataset.paths, dataset.targets))
    assert sorted(seen) == expected
    if order == "sequential":
        assert [label for _, label in seen] == sorted(label for _, label in seen)


def test_make_loader_order_errors_and_random_advice(sorted_tree, tmp_path):
    out = tmp_path / "e.lmdb"
    pack(str(sorted_tree), "lmdb", str(out), progress=False, workers=1)
    dataset = readers.LMDBDataset(out, decode="raw")
    with pytest.raises(ValueError, match="order must be one of"):
        make_loader(dataset, 4, workers=0, order="zigzag")
    with pytest.raises(ValueError, match="cannot also shuffle"):
        make_loader(dataset, 4, workers=0, order="sequential", shuffle=True)
    make_loader(dataset, 4, workers=0, order="block")
    assert dataset.reader.access == "sequential"
    make_loader(dataset, 4, workers=0)
    assert dataset.reader.access == "random"
    shards = tmp_path / "e.wds"
    pack(str(sorted_tree), "wds", str(shards), progress=False, workers=1)
    with pytest.raises(ValueError, match="IterableDataset"):
        make_loader(readers.WDSDataset(shards), 4, workers=0, order="block")


def block_rank(rank: int, world_size: int, out: str, init_file: str, results: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        dataset = readers.LMDBDataset(out, decode="raw", transform=len)
        loader = make_loader(dataset, 4, workers=1, order="block", block_size=4, window=2, drop_last=False,
                             multiprocessing_context="spawn")
        assert isinstance(loader.sampler, BlockShuffleSampler) and loader.sampler.world() == (rank, world_size)
        order = [int(i) for i in loader.sampler]  # epoch 0, as the loader's first pass reads it
        sizes = [int(n) for batch, _ in loader for n in batch]
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (order, sizes))
        if rank == 0:
            with open(results, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def test_make_loader_block_order_under_ddp_with_spawned_workers(sorted_tree, tmp_path):
    import json

    import torch.multiprocessing

    out = tmp_path / "ddp.lmdb"
    pack(str(sorted_tree), "lmdb", str(out), progress=False, workers=1)
    results = tmp_path / "ranks.json"
    torch.multiprocessing.spawn(block_rank, args=(2, str(out), str(tmp_path / "init"), str(results)), nprocs=2)
    (order0, sizes0), (order1, sizes1) = json.loads(results.read_text())
    assert len(order0) == len(order1) == len(sizes0) == len(sizes1) == 20  # 40 records, equal shares
    assert not set(order0) & set(order1) and sorted(order0 + order1) == list(range(40))
    dataset = readers.LMDBDataset(out, decode="raw")
    expected = sorted(os.path.getsize(sorted_tree / p) for p in dataset.paths)
    assert sorted(sizes0 + sizes1) == expected
