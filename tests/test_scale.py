"""Tables at scale: mapped from the pack (shared page cache), not copied into each process,
still checked when they load; and the corpus shape the scale benchmark packs."""
from __future__ import annotations

import json
import mmap
import os
import pickle
import subprocess
import sys

import h5py
import lmdb
import numpy as np
import pytest

from packer import FORMATS, open_reader
from packer.errors import CorruptDataError
from packer.formats import _tables
from packer.pack import write_dataset
from packer.records import Metadata, PathTable, SplitInfo, checksum

from conftest import jpeg_bytes

CLASSES = 10


def build(fmt: str, tmp_path, count: int, shuffled: bool = False) -> str:
    """A pack of count tiny records written straight through the format's Writer (no
    source folder: seconds, not minutes), with long paths so the path table is large."""
    out = str(tmp_path / f"scale{FORMATS[fmt].extension}")
    image = jpeg_bytes(0, size=(8, 8))
    labels = (np.arange(count) % CLASSES).astype(np.int32)
    paths = [f"class_{i % CLASSES:03d}/a_rather_long_file_name_{i:08d}_as_real_datasets_have_in_their_folders.JPEG"
             for i in range(count)]
    order = np.random.default_rng(0).permutation(count) if shuffled else None

    def fill(writer) -> Metadata:
        writer.begin_split("train", expected_count=count)
        total = 0
        for i in (range(count) if order is None else order.tolist()):
            data = image[:2] + b"\xff\xfe\x00\x0a" + i.to_bytes(8, "little") + image[2:]  # a COM segment
            writer.add(data, int(labels[i]), paths[i], checksum(data))
            total += len(data)
        writer.end_split(labels, PathTable.from_strings(paths), order=None if order is None else order)
        return Metadata(format=fmt, classes=[f"class_{k:03d}" for k in range(CLASSES)],
                        splits={"train": SplitInfo(count, total, np.bincount(labels, minlength=CLASSES).tolist())})

    write_dataset(fmt, out, False, None, fill)
    return out


def maps_file(array: np.ndarray | memoryview) -> bool:
    """Whether array's memory is a file map (numpy does not own it, an mmap does); a
    memoryview (an int_view) is followed to the array it views."""
    base = array.obj if isinstance(array, memoryview) else array
    while isinstance(base, np.ndarray):
        if base.flags.owndata:
            return False
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer's view of the map
        base = base.obj
    return isinstance(base, mmap.mmap)


def tables_of(reader) -> dict[str, np.ndarray | memoryview]:
    """Every per-record table a loaded reader holds."""
    found = {"labels": reader.labels, "path blob": np.frombuffer(reader.paths.data, np.uint8)}
    if hasattr(reader, "records"):
        found["records"] = reader.records
    if hasattr(reader, "index"):
        found["offsets"], found["crc32"] = reader.index()
    if hasattr(reader, "extents"):
        found["extents"] = reader.extents()
    sums = reader.record_sums() if hasattr(reader, "record_sums") else False
    if sums is not False:  # False: a pack without sums
        found["sums"] = sums
    if reader.storage_order() is not None and not hasattr(reader, "records"):
        found["order"] = reader.storage_order()
    return found


@pytest.fixture(params=list(FORMATS))
def fmt(request):
    return request.param


@pytest.mark.parametrize("shuffled", [False, True])
def test_every_table_is_mapped_from_the_pack_not_copied(fmt, tmp_path, shuffled):
    out = build(fmt, tmp_path, 3000, shuffled=shuffled)
    reader = open_reader(out).open()
    tables = tables_of(reader)
    assert {"labels", "path blob"} <= tables.keys()
    for name, table in tables.items():
        assert maps_file(table), f"{fmt}: {name} is a copy, not a map of the pack"
    assert isinstance(reader.paths.data, mmap.mmap)
    for i in (0, 1234, 2999):
        data, label, relpath = reader.read(i)
        assert label == i % CLASSES and relpath.endswith(f"_{i:08d}_as_real_datasets_have_in_their_folders.JPEG")
        assert int.from_bytes(data[6:14], "little") == i
    reader.close()


def private_dirty() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Private_Dirty:"))


def touch(table: np.ndarray) -> None:
    """Read every byte of a table without copying it (a CRC-32 of it, or a reduction over a strided view)."""
    table = np.asarray(table)  # an int_view: the array it views
    if table.flags.c_contiguous:
        _tables.table_crc(memoryview(table.reshape(-1).view(np.uint8)))
    else:
        table.min()


WORKER = """
import ctypes, json, sys
try:  # glibc: temporaries over 64 KB are mapped and given back when freed, not left on the heap
    ctypes.CDLL(None).mallopt(-3, 65536)  # M_MMAP_THRESHOLD
except (AttributeError, OSError):
    pass
sys.path.insert(0, sys.argv[2])
from test_scale import private_dirty, tables_of, touch
from packer import open_reader

reader = open_reader(sys.argv[1])
reader.handle()  # the library's own state (HDF5's caches, LMDB's environment): not tables
before = private_dirty()
reader.open()
touched = 0
for table in tables_of(reader).values():  # every page of every table read
    touched += table.nbytes
    touch(table)
print(json.dumps([private_dirty() - before, touched]))
"""


def test_a_process_opening_the_pack_copies_no_table(fmt, tmp_path):
    # A worker or rank loads every table itself: its private memory (Private_Dirty: what
    # no other process can share) grows by the small derived tables only (path offsets, 4
    # bytes a record), not by the tables (over 100 bytes a record here), which it maps:
    # their pages stay clean page cache, shared by every process that reads the dataset.
    # (The allocator is told to give freed temporaries back, so they do not count.) A copy
    # of the tables would grow it by at least what was touched.
    out = build(fmt, tmp_path, 30_000)
    opened = open_reader(out).open()
    assert len(pickle.dumps(opened)) < 64 << 10  # no tables travel with a pickled reader
    assert pickle.loads(pickle.dumps(opened)).read(29_999) == opened.read(29_999)
    found = subprocess.run([sys.executable, "-c", WORKER, out, os.path.dirname(__file__)], capture_output=True,
                           text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    grown, touched = json.loads(found.stdout.strip().splitlines()[-1])
    assert touched > 2 << 20
    assert grown < touched / 2, f"{fmt}: private memory grew by {grown} bytes for {touched} bytes of tables"


def flip_a_table_byte(fmt: str, out: str) -> None:
    """Damage the labels table in place, keeping its length."""
    if fmt == "lmdb":
        with lmdb.open(out, subdir=True, lock=False) as env, env.begin(write=True) as txn:
            raw = bytearray(txn.get(b"train/labels"))
            raw[len(raw) // 2] ^= 0x01
            txn.put(b"train/labels", bytes(raw))
    elif fmt == "hdf5":
        with h5py.File(out, "r+") as f:
            f["train/labels"][1500] ^= 1
    else:
        path = os.path.join(out, "train", "records.bin")
        with open(path, "r+b") as f:
            f.seek(1500 * 28 + 24)
            value = f.read(1)
            f.seek(1500 * 28 + 24)
            f.write(bytes([value[0] ^ 1]))


def test_a_damaged_mapped_table_is_refused_when_it_is_checked(fmt, tmp_path):
    out = build(fmt, tmp_path, 3000)
    flip_a_table_byte(fmt, out)
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        open_reader(out).check_tables()


def mapped_rss(path: str) -> int:
    """Bytes of this process's maps of the file at path that are resident (pages it touched)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:  # a mapping's first line: its range, ..., its file
                mine = fields[-1] == path
            elif mine and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def open_peak(reader) -> int:
    """The most bytes Python and numpy held at once during reader.open()."""
    import tracemalloc

    tracemalloc.start()
    reader.open()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_opening_a_large_hdf5_pack_reads_no_table_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(_tables, "CRC_AT_OPEN", 0)  # these tables stand for ones past the limit
    # Open maps the tables and checks their sizes and ends: no array per record is made
    # (the path table's offsets were 4 bytes a record) and only a few pages of the tables
    # are touched; a read checks the blocks it uses, check_tables every table whole.
    from benchmarks import tiny

    records = 100_000
    out = str(tmp_path / "tiny.h5")
    tiny.write_tiny_pack(out, records)
    reader = open_reader(out)
    peak = open_peak(reader)
    assert peak < records, f"open allocated {peak} bytes for {records} records"
    offsets, _ = reader.index()
    # Pages of the 3.3 MB of tables mapped in (a fault maps its neighbours too, up to 64 KB)
    assert offsets.nbytes == 8 * (records + 1) and mapped_rss(out) < 512 << 10
    assert reader.read_image(records - 1) == ((records - 1).to_bytes(5, "little"), tiny.CLASSES - 1)
    assert mapped_rss(out) < 1 << 20  # the read's blocks, not the tables
    reader.check_tables()
    assert mapped_rss(out) > 16 * records  # every table read whole
    reader.close()


def test_a_table_past_the_end_of_its_file_is_refused_not_mapped(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptDataError, match="past the end of the 100-byte file"):
            _tables.map_region(fd, 50, 51, str(path))
        region, start = _tables.map_region(fd, 50, 50, str(path))
        assert region[start:start + 50] == b"x" * 50
    finally:
        os.close(fd)


def test_a_mapped_path_table_pickles_as_its_bytes(tmp_path):
    out = build("wds", tmp_path, 3000)
    paths = open_reader(out).paths
    assert isinstance(paths.data, mmap.mmap)
    copy = pickle.loads(pickle.dumps(paths))
    assert isinstance(copy.data, bytes) and list(copy) == list(paths)


def test_path_table_subset_keeps_the_chosen_paths_in_order():
    paths = PathTable.from_strings([f"c/{i}.jpg" for i in range(10)])
    keep = np.array([i % 3 != 0 for i in range(10)])
    assert list(paths.subset(keep)) == [f"c/{i}.jpg" for i in range(10) if i % 3]
    assert list(paths.subset(~keep)) == ["c/0.jpg", "c/3.jpg", "c/6.jpg", "c/9.jpg"]
    assert len(paths.subset(np.zeros(10, bool))) == 0 and paths.subset(np.ones(10, bool)) is paths


def test_order_tables_must_be_permutations():
    assert _tables.is_permutation(np.random.default_rng(0).permutation(200_000).astype(np.int32))
    assert not _tables.is_permutation(np.array([0, 1, 1, 3], np.int32))
    assert not _tables.is_permutation(np.array([0, 1, 2, 4], np.int32))
    assert not _tables.is_permutation(np.array([0, -1, 2, 3], np.int32))


def test_the_benchmark_corpus_has_imagenet_class_counts():
    from benchmarks.scale import class_counts, imagenet_class_counts

    counts = imagenet_class_counts()
    assert len(counts) == 1000 and counts.sum() == 1_281_167
    assert counts.min() == 732 and counts.max() == 1300 and (counts == 1300).sum() >= 850
    assert (imagenet_class_counts() == counts).all()  # deterministic
    for records in (20_000, 200_000):
        scaled = class_counts(records)
        assert scaled.sum() == records and len(scaled) == 1000


def test_the_tiny_record_study_packs_what_it_says_and_extrapolates_from_slopes_over_every_size(tmp_path):
    from benchmarks import tiny

    out = tmp_path / "t.hdf5"
    tiny.write_tiny_pack(str(out), 3_001)
    reader = open_reader(str(out), "train").open()
    assert len(reader) == 3_001 and reader.classes[0] == "c0000" and len(reader.classes) == 1000
    assert [reader.read(i)[0] for i in (0, 1_500, 3_000)] == [i.to_bytes(5, "little") for i in (0, 1_500, 3_000)]
    assert reader.paths[3_000] == "c0999/0000003000" and reader.labels[1_500] == 1_500 * 1000 // 3_001
    reader.close()
    row = {key: 1.0 for key in (*tiny.SCALARS, "pack_rate")} | {
        "main": {"uss_mb": 10.0}, "workers": [{"uss_mb": 10.0, "private_dirty_mb": 9.0}]}
    rows = [row | {"records": 10, "first_batch_s": 2.0}, row | {"records": 110, "open_s": 2.0},
            row | {"records": 210, "open_s": 3.0}]
    far = tiny.extrapolated(rows, 1_010)  # open: 0.01 s a record from 210's 3.0; first batch falls: flat
    assert far["open_s"] == pytest.approx(11.0) and far["first_batch_s"] == 1.0 and far["main"]["uss_mb"] == 10.0
    assert far["workers"] == [{"uss_mb": 10.0, "private_dirty_mb": 9.0}]
    assert "1,000 (extrapolated)" not in tiny.table(rows) and "400,000,000 (extrapolated)" in tiny.table(rows)


def test_the_tiny_record_study_takes_a_resumes_figure_from_its_pairs_ratios():
    from benchmarks import tiny

    # A slow pair moves the medians of fresh starts and resumes apart; the ratios' median holds.
    pairs = [[1.0, 1.1], [2.0, 2.2], [0.5, 0.5], [1.0, 0.9], [4.0, 1.0]]
    found = tiny.resume_figures(pairs)
    assert found["resume_ratio"] == pytest.approx(1.0) and found["resume_pairs"] == pairs
    assert found["fresh_2_ranks_s"] == 1.0 and found["resume_2_ranks_s"] == pytest.approx(1.0)
    assert found["resume_ratio_quartiles"] == pytest.approx([0.9, 1.1])
    assert tiny.resume_ratio(found) == "1.00 (0.90-1.10)"
    assert tiny.resume_ratio({"fresh_2_ranks_s": 2.0, "resume_2_ranks_s": 1.0}) == "0.50"  # one pair, as before


def test_opening_a_webdataset_pack_checks_no_table_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(_tables, "CRC_AT_OPEN", 0)  # these tables stand for ones past the limit
    # records.bin is mapped and its size checked; a read checks the block of records it lands in.
    from benchmarks import tiny

    records = 40_000
    out = str(tmp_path / "tiny.wds")
    tiny.write_tiny_pack(out, records, fmt="wds")
    reader = open_reader(out)
    peak = open_peak(reader)
    assert peak < records, f"open allocated {peak} bytes for {records} records"
    assert reader.read_image(records - 1) == ((records - 1).to_bytes(5, "little"), tiny.CLASSES - 1)
    reader.check_tables()
    reader.close()
