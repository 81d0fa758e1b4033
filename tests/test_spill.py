"""Packing with flat memory: per-record tables spilled to unlinked files and read back a chunk
at a time, mapped tables whose pages are dropped after use, and listings compared as streams."""
from __future__ import annotations

import mmap
import os
import shutil

import numpy as np
import pytest

from packer import open_reader, pack
from packer.convert import RecordJobs
from packer.formats._tables import SpillTable, array_chunks, drop_pages, int_view, mapped_region, spilled_array
from packer.writing import kept_order
from packer.scan import scan_source
from packer.verify import _Unordered, listing_changes, listing_changes_unordered

ROW = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("label", "<i4")])


def rows(count: int) -> np.ndarray:
    values = np.empty(count, ROW)
    values["shard"] = np.arange(count) // 7
    values["offset"] = np.arange(count, dtype=np.uint64) * 4099 + 2**40
    values["label"] = np.arange(count) % 13 - 1
    return values


@pytest.mark.parametrize("count", [0, 1, 99, 100, 1000])
def test_a_spill_table_reads_back_what_was_appended(tmp_path, count):
    expected = rows(count)
    table = SpillTable(ROW, str(tmp_path), block=100)
    for row in expected.tolist():
        table.append(row)
    assert len(table) == count
    chunks = list(table.chunks(size=64))
    assert all(len(c) <= 64 for c in chunks)
    got = np.concatenate(chunks) if chunks else np.empty(0, ROW)
    assert got.tobytes() == expected.tobytes()
    assert bytes(table.map()) == expected.tobytes()
    order = np.random.default_rng(count).permutation(count)
    rearranged = np.empty(count, ROW)
    rearranged[order] = expected
    chunks = list(table.chunks_in(order, size=37))
    assert all(len(c) <= 37 for c in chunks)
    got = np.concatenate(chunks) if chunks else np.empty(0, ROW)
    assert got.tobytes() == rearranged.tobytes()
    table.close()
    assert os.listdir(tmp_path) == []  # the file never had a name: nothing is left behind


def test_a_spilled_array_is_mapped_from_a_nameless_file(tmp_path):
    values = np.random.default_rng(0).permutation(100_000).astype(np.int32)
    spilled = spilled_array(values, str(tmp_path))
    assert isinstance(mapped_region(spilled), mmap.mmap) and not spilled.flags.owndata
    assert np.array_equal(spilled, values) and spilled.dtype == values.dtype
    assert os.listdir(tmp_path) == []
    assert spilled_array(values, None) is values  # no folder: kept as it is
    assert np.array_equal(np.concatenate(list(array_chunks(spilled, 4096))), values)


def resident_kb(address: int) -> int:
    """Rss of the mapping of this process that starts at address (/proc/self/smaps)."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                found = int(head.split("-")[0], 16) == address
            elif found and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_DONTNEED"),
                    reason="needs Linux's /proc/self/smaps and madvise")
def test_dropping_a_mapped_table_s_pages_takes_them_out_of_rss(tmp_path):
    spilled = spilled_array(np.arange(1 << 20, dtype=np.int64), str(tmp_path))  # 8 MB
    address = np.frombuffer(mapped_region(spilled), np.uint8).ctypes.data
    assert int(spilled.sum()) == (1 << 20) * ((1 << 20) - 1) // 2  # every page read: resident
    assert resident_kb(address) >= 8 * 1024 - 64
    drop_pages(spilled)
    assert resident_kb(address) < 1024
    assert int(spilled[-1]) == (1 << 20) - 1  # still readable: the pages fault back in from the file


def test_an_int_view_indexes_a_mapped_table_as_ints_without_copying_it(tmp_path):
    sums = np.array([0, 1, 2**32 - 1, 12345], "<u4")
    path = tmp_path / "sums"
    path.write_bytes(sums.tobytes() + sums.astype(">u4").tobytes())
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(region, "<u4", len(sums))
    view = int_view(mapped)
    assert [type(view[k]) for k in range(len(sums))] == [int] * len(sums)
    assert list(view) == sums.tolist()
    assert np.shares_memory(np.asarray(view), mapped)  # one table per process, as mapped
    swapped = int_view(np.frombuffer(region, ">u4", len(sums), sums.nbytes))
    assert (swapped.format, list(swapped)) == ("I", sums.tolist())  # the other byte order, converted
    assert len(int_view(mapped[:0])) == 0


def test_a_spilled_scan_lists_what_an_in_memory_one_does(image_tree, tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    held = scan_source(image_tree).splits["all"]
    spilled = scan_source(image_tree, spill_dir=str(spill)).splits["all"]
    assert isinstance(spilled.paths.data, mmap.mmap) and isinstance(mapped_region(spilled.labels), mmap.mmap)
    assert list(spilled.paths) == list(held.paths) and len(spilled.paths) > 0
    assert spilled.paths.to_nul_separated() == held.paths.to_nul_separated()
    assert bytes(spilled.paths.data) == bytes(held.paths.data)  # the blob ends at the last path, as before
    assert np.array_equal(spilled.labels, held.labels)
    assert os.listdir(spill) == []


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_a_pack_leaves_no_spill_file_and_reads_back_its_source(image_tree, tmp_path, fmt):
    out = tmp_path / "out" / f"data.{fmt}"
    out.parent.mkdir()
    pack(str(image_tree), fmt, str(out), workers=2, progress=False, shuffle=fmt != "hdf5")
    assert os.listdir(out.parent) == [out.name]
    listing = scan_source(image_tree).splits["all"]
    reader = open_reader(str(out), "all")
    assert list(reader.paths) == list(listing.paths)
    assert np.array_equal(reader.labels, listing.labels)
    for i in range(len(reader)):
        data, label, relpath = reader.read(i)
        assert data == (image_tree / relpath).read_bytes() and label == listing.labels[i]
    reader.close()


def test_kept_order_ranks_the_kept_samples():
    order = np.random.default_rng(1).permutation(50).astype(np.int32)
    assert kept_order(order, np.ones(50, bool)) is order
    kept = np.arange(50) % 3 != 0
    rank = np.cumsum(kept) - 1
    assert np.array_equal(kept_order(order, kept), rank[order[kept[order]]])


def test_convert_jobs_are_made_as_asked():
    class Listing:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    listings = {"train": Listing(5), "val": Listing(3)}
    orders = {"train": np.array([3, 0, 4, 1, 2], np.int32), "val": None}
    jobs = RecordJobs(listings, orders)
    expected = [("train", 3), ("train", 0), ("train", 4), ("train", 1), ("train", 2), ("val", 0), ("val", 1),
                ("val", 2)]
    assert len(jobs) == 8 and [jobs[k] for k in range(8)] == expected and jobs[2:7] == expected[2:7]
    with pytest.raises(IndexError):
        jobs[8]


def test_streamed_listing_comparison_equals_the_dictionary_one(image_tree, tmp_path):
    src = tmp_path / "copy"
    shutil.copytree(image_tree, src)
    before = scan_source(src).splits["all"]
    classes = scan_source(src).classes
    files = [src / relpath for relpath in before.paths]
    files[0].unlink()  # removed
    (files[1].parent / "zz_new.jpg").write_bytes(files[1].read_bytes())  # added
    other = next(d for d in src.iterdir() if d.is_dir() and d != files[2].parent)
    files[2].rename(other / files[2].name)  # moved to another class
    sub = files[3].parent / "sub"
    sub.mkdir()
    (sub / "in_a_sub_folder.jpg").write_bytes(files[3].read_bytes())  # added, in a sub-folder
    source = scan_source(src)
    after = source.splits["all"]

    def entries(listing, names):
        return [(p, names[int(label)]) for p, label in zip(listing.paths, listing.labels)]

    streamed = listing_changes("all", iter(entries(before, classes)), iter(entries(after, source.classes)))
    expected = listing_changes_unordered(before.paths, before.labels, after, source.classes, classes)
    assert streamed == expected
    added, removed, changed = streamed
    relative = [str(f.relative_to(src)) for f in files]
    assert {relative[0], relative[2]} <= set(removed) and not changed
    assert {str((files[1].parent / "zz_new.jpg").relative_to(src)),
            str((sub / "in_a_sub_folder.jpg").relative_to(src))} <= set(added)
    with pytest.raises(_Unordered):  # a listing in no known order is not joined as a stream
        listing_changes("all", iter(entries(before, classes)[::-1]), iter(entries(after, source.classes)))



@pytest.mark.parametrize("spill", [False, True])
def test_kept_paths_equals_subset_block_by_block(image_tree, tmp_path, spill):
    from packer.scan import kept_paths

    listing = scan_source(image_tree, spill_dir=str(tmp_path) if spill else None).splits["all"]
    kept = np.arange(len(listing.paths)) % 3 != 1
    expected = listing.paths.subset(kept)
    for block in (1, 2, 5, 1 << 16):
        got = kept_paths(listing.paths, kept, str(tmp_path) if spill else None, block=block)
        assert list(got) == list(expected) and got.to_nul_separated() == expected.to_nul_separated()
    assert kept_paths(listing.paths, np.ones(len(kept), bool), None) is listing.paths
    assert len(kept_paths(listing.paths, np.zeros(len(kept), bool), None)) == 0


def test_a_folder_that_cannot_take_a_spill_file_keeps_the_table_in_memory(tmp_path):
    missing = str(tmp_path / "no such folder")
    values = np.arange(10, dtype=np.int32)
    assert spilled_array(values, missing) is values
    from packer.scan import PathBlob

    blob = PathBlob(missing)
    blob.extend([b"a/b.jpg", b"a/c.jpg"])
    table = blob.table()
    assert list(table) == ["a/b.jpg", "a/c.jpg"] and isinstance(table.data, bytes)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_DONTNEED"),
                    reason="needs Linux's /proc/self/smaps and madvise")
def test_the_part_fingerprint_leaves_a_spilled_listing_unresident(image_tree, tmp_path):
    """--part hashes the whole listing (packer.parts.source_fingerprint): its mapped tables
    are touched whole, and must not stay resident (46 MB of paths at 1.28M records)."""
    from packer.cut import source_fingerprint
    spill = tmp_path / "spill"
    spill.mkdir()
    source = scan_source(image_tree, spill_dir=str(spill))
    listing = source.splits["all"]
    held = scan_source(image_tree)
    address = np.frombuffer(listing.paths.data, np.uint8).ctypes.data
    assert source_fingerprint(source) == source_fingerprint(held)  # the same digest, mapped or held
    assert resident_kb(address) == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, whose writes fail with ENOSPC")
def test_a_full_disk_under_the_scan_s_spill_file_is_a_pack_error_naming_the_folder(tmp_path):
    from packer.errors import PackError
    from packer.scan import PathBlob
    blob = PathBlob(str(tmp_path))
    blob.file.close()
    blob.file = open("/dev/full", "wb", buffering=0)  # the spill file on a disk that is full
    try:
        with pytest.raises(PackError, match="free some space") as caught:
            blob.extend([b"n01440764/n01440764_10026.JPEG"] * 10)
        assert str(tmp_path) in str(caught.value)
    finally:
        blob.file.close()
