"""ReaderDataset.__getitems__: a DataLoader's whole batch, read with its reads started together."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import readers
from benchmarks import cache
from packer import pack
from packer.formats import _io
from readers import FolderDataset, ResizeCenterCrop
from readers import sampler as sampler_module

from conftest import class_sorted_tree
from test_sampler import evicted

FORMATS = {"lmdb": ".lmdb", "hdf5": ".h5", "wds": ".wds"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return class_sorted_tree(tmp_path_factory.mktemp("getitems") / "src", classes=3, per_class=30)


@pytest.fixture(scope="module")
def packed(tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("getitems-packed")
    paths = {}
    for fmt, suffix in FORMATS.items():
        paths[fmt] = out / f"d{suffix}"
        pack(str(tree), fmt, str(paths[fmt]), progress=False, workers=1)
    return paths


def datasets(tree, packed, **kwargs):
    yield "folder", FolderDataset(tree, **kwargs)
    for fmt, path in packed.items():
        yield fmt, readers.open_dataset(path, **kwargs)


def data_files(dataset) -> list[str]:
    path = dataset.reader.path
    return [p for p in cache.data_files(path) if p.endswith((".mdb", ".tar")) or p == path]


def test_a_batch_is_the_items_one_by_one_in_order(tree, packed):
    batch = [5, 0, 89, -1, -90, 44, 44]
    for name, dataset in datasets(tree, packed, decode="raw"):
        got = dataset.__getitems__(batch)
        assert isinstance(got, list), name
        assert got == [dataset[i] for i in batch] == [dataset[i % 90] for i in batch], name
        assert dataset.__getitems__([]) == []
        dataset.close()


def test_a_bad_index_in_a_batch_is_refused_as_ds_i_refuses_it(tree, packed):
    for name, dataset in datasets(tree, packed, decode="raw"):
        for bad in (90, -91):
            with pytest.raises(IndexError) as theirs:
                dataset[bad]
            with pytest.raises(IndexError) as ours:
                dataset.__getitems__([1, bad])
            assert str(ours.value) == str(theirs.value), name
        dataset.close()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_a_batch_checks_its_file_once_and_a_subclass_getitem_still_reads_each_item(packed, fmt, monkeypatch):
    dataset = readers.open_dataset(packed[fmt], decode="raw")
    checks, check = [], dataset.reader.check_not_cut
    monkeypatch.setattr(dataset.reader, "check_not_cut", lambda: (checks.append(1), check())[1])
    assert len(dataset.__getitems__(list(range(64)))) == 64
    assert len(checks) == 1  # one fstat for the batch (docs/safety.md), not one more per item
    dataset[3]
    assert len(checks) == 2

    class Tagged(type(dataset)):
        def __getitem__(self, index):
            image, label = super().__getitem__(index)
            return image, label + 1000

    tagged = Tagged(packed[fmt], decode="raw")
    assert [label for _, label in tagged.__getitems__([0, 45, 89])] == [dataset[i][1] + 1000 for i in (0, 45, 89)]
    dataset.close()
    tagged.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_shuffled_dataloader_collates_the_batches_by_default(tree, packed, workers):
    """The README's drop-in: DataLoader(ds, shuffle=True), torch's default collate."""
    for name, dataset in datasets(tree, packed, decode="numpy", transform=ResizeCenterCrop(32)):
        # shuffle=True's RandomSampler, drawn up front so the test knows the order.
        order = list(tud.RandomSampler(dataset, generator=torch.Generator().manual_seed(3)))
        loader = tud.DataLoader(dataset, batch_size=16, sampler=order, num_workers=workers)
        seen = []
        for images, labels in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, 32, 32), name
            seen += labels.tolist()
            k = len(seen) - len(labels)
            expected = [dataset[i] for i in order[k:len(seen)]]
            assert torch.equal(images, torch.stack([image for image, _ in expected])), name
            assert labels.tolist() == [label for _, label in expected], name
        assert len(seen) == 90 and sorted(seen) == sorted(dataset.targets.tolist()), name
        dataset.close()


def test_a_subset_passes_its_batches_through(tree, packed):
    dataset = readers.open_dataset(packed["lmdb"], decode="raw")
    subset = tud.Subset(dataset, [7, 3, 60])
    assert subset.__getitems__([2, 0]) == [dataset[60], dataset[7]]
    assert [len(b) for b in tud.DataLoader(subset, batch_size=2, collate_fn=list)] == [2, 1]
    dataset.close()


def record_calls(monkeypatch, dataset) -> list:
    """Every hint (its indexes) and read (its index) the dataset's reader gets, in order; both still happen."""
    reader, events = dataset.reader, []
    hint, read = reader.will_need_records, reader.read_image

    def hinting(indexes):
        events.append(("hint", np.asarray(indexes).tolist()))
        return hint(indexes)

    def reading(index):
        events.append(("read", index))
        return read(index)

    monkeypatch.setattr(reader, "will_need_records", hinting)
    monkeypatch.setattr(reader, "read_image", reading)
    return events


needs_page_cache_control = pytest.mark.skipif(
    not cache.CAN_EVICT or cache.resident_fraction([__file__]) is None or not _io.CAN_PROBE,
    reason="needs posix_fadvise, mincore and RWF_NOWAIT")


@needs_page_cache_control
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_cold_batch_is_hinted_whole_before_its_first_read(packed, fmt, monkeypatch):
    dataset = readers.open_dataset(packed[fmt], decode="raw").open()
    events = record_calls(monkeypatch, dataset)
    evicted(data_files(dataset), dataset)  # one eviction can leave pages behind: repeated until none go
    batch = np.random.default_rng(0).permutation(90)[:40].tolist()
    dataset.__getitems__(batch)
    hints = [e for e in events if e[0] == "hint"]
    # Every record hinted, HINT_CHUNK at a time, before the first read; then the reads in batch order.
    assert events[:len(hints)] == hints and len(hints) == -(-40 // sampler_module.HINT_CHUNK)
    assert [i for _, chunk in hints for i in chunk] == batch
    assert [i for kind, i in events[len(hints):]] == batch
    dataset.close()


@needs_page_cache_control
def test_warm_batches_back_off_and_cold_ones_are_hinted_again(packed, monkeypatch):
    dataset = readers.open_dataset(packed["hdf5"], decode="raw").open()
    events = record_calls(monkeypatch, dataset)
    files = data_files(dataset)
    cache.load(files)
    for k in range(6):  # 6 warm batches of 16: one chunk each
        dataset.__getitems__(list(range(16 * (k % 5), 16 * (k % 5) + 16)))
    # Found cached at the 1st chunk, skips 1; cached at the 3rd, skips 2: hinted at 1, 3 and 6.
    assert sum(kind == "hint" for kind, _ in events) == 3
    evicted(files, dataset)
    dataset.read_ahead().skip = 0  # as after the skipped calls run out
    events.clear()
    dataset.__getitems__(list(range(48)))
    assert [kind for kind, _ in events[:3]] == ["hint"] * 3 and dataset.read_ahead().backoff == 0
    dataset.close()


@needs_page_cache_control
def test_a_warm_batch_whose_hints_are_all_skipped_works_out_no_records(packed, monkeypatch):
    dataset = readers.open_dataset(packed["hdf5"], decode="raw").open()
    cache.load(data_files(dataset))
    worked, hintable = [], dataset.hintable
    monkeypatch.setattr(dataset, "hintable", lambda indexes: worked.append(len(indexes)) or hintable(indexes))
    for _ in range(12):  # warm batches of two chunks: the hints back off 1, 2, 4, 8 and 16 calls
        dataset.__getitems__(list(range(32)))
    # Hinted in batches 1, 2, 3, 6 and 10, one chunk each; the other 7 skipped whole, their records not worked out.
    assert len(worked) == dataset.read_ahead().calls == 5
    dataset.close()


def test_the_folder_takes_no_hints_and_reads_one_at_a_time(tree):
    """The baseline stays what torchvision's ImageFolder does: one file read after another."""
    dataset = FolderDataset(tree, decode="raw")
    assert dataset.read_ahead() is None
    assert dataset.__getitems__([3, 1]) == [dataset[3], dataset[1]]
