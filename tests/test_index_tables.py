"""The path_offsets and positions tables (packer.formats._index_tables): a DataLoader worker reading
a pack of any format, paths included, holds nothing per record, nor does one checking a shuffled
pack's order where positions is stored; damaged tables are named; packs written before them
still read."""
from __future__ import annotations

import json
import pickle
import tracemalloc
import zlib

import h5py
import lmdb
import numpy as np
import pytest
import torch.utils.data

import readers
from packer import checksum as record_checksums
from packer.errors import CorruptDataError
from packer.formats import open_reader
from packer.formats._index_tables import inverse_chunks
from packer.records import Metadata, PathTable, SplitInfo
from packer.writing import now_utc, write_dataset

CLASSES = 10
SIZES = (4_000, 100_000)
READS = 2_000
PER_RECORD = 1.0  # bytes a record the worker may add: a table of 4 bytes a record adds 384 KB


def names_of(records: int) -> tuple[np.ndarray, list[str]]:
    labels = (np.arange(records) * CLASSES // records).astype(np.int32)
    return labels, [f"c{label:04d}/{i:07d}" for i, label in enumerate(labels.tolist())]


def write_pack(out: str, records: int, fmt: str, shuffled: bool) -> str:
    """A pack of records of 5 bytes (the record's number), stored in a seeded shuffled order
    (the writer's order argument) or in index order."""
    labels, names = names_of(records)
    order = np.random.default_rng(0).permutation(records).astype(np.int32) if shuffled else None
    checksum = record_checksums.function(record_checksums.DEFAULT)

    def fill(writer) -> Metadata:
        writer.begin_split("train", expected_count=records)
        for j in range(records):
            i = int(order[j]) if shuffled else j
            data = i.to_bytes(5, "little")
            writer.add(data, int(labels[i]), names[i], checksum(data))
        writer.end_split(labels, PathTable.from_strings(names), order)
        counts = np.bincount(labels, minlength=CLASSES).tolist()
        return Metadata(format=fmt, classes=[f"c{k:04d}" for k in range(CLASSES)],
                        splits={"train": SplitInfo(records, 5 * records, counts)}, source="synthetic",
                        created=now_utc(), packer_version="test", params={"format": fmt},
                        checksum=record_checksums.DEFAULT)

    write_dataset(fmt, out, True, None, fill, record_checksums.DEFAULT)
    return out


class TracedReads(torch.utils.data.IterableDataset):
    """In a DataLoader worker: READS random reads of the pack, each through the Dataset, its
    path through Dataset.paths and through packer's Reader.read, their allocations traced:
    yields (what the reads returned checked, bytes kept at the end, the most held at once)."""

    def __init__(self, path: str):
        self.dataset = readers.open_dataset(path, decode="raw")
        self.reader = open_reader(path)

    def __iter__(self):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        count, good = len(self.dataset), 0
        for i in np.random.default_rng(1).integers(0, count, READS).tolist():
            data, label = self.dataset[i]
            name = f"c{label:04d}/{i:07d}"
            good += int.from_bytes(data, "little") == i and label == i * CLASSES // count
            good += self.dataset.paths[i] == name and self.reader.read(i)[2] == name
        kept, peak = tracemalloc.get_traced_memory()
        yield good, kept - before, peak - before
        tracemalloc.stop()


def in_worker(dataset: TracedReads) -> tuple[int, int, int]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
    return next(iter(loader))


def warmed(path: str) -> str:
    """path, once a record was read through it here: what reads import is then imported in
    the process the workers fork from, not counted in the first pack's figures."""
    dataset, reader = readers.open_dataset(path, decode="raw"), open_reader(path)
    dataset[0], dataset.paths[0], reader.read(0)
    dataset.close()
    reader.close()
    return path


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[tuple, str]:
    folder = tmp_path_factory.mktemp("index-tables")
    return {(fmt, shuffled, records): warmed(write_pack(str(folder / f"{records}-{shuffled}.{fmt}"), records, fmt,
                                                        shuffled))
            for fmt, shuffled in PACKS for records in SIZES}


PACKS = [("lmdb", False), ("lmdb", True), ("hdf5", True), ("wds", True)]


@pytest.mark.parametrize("fmt, shuffled", PACKS)
def test_a_worker_reading_at_random_holds_nothing_per_record(packs, fmt, shuffled):
    # Labels and each format's own tables mapped and checked a block at a time; each path
    # found through the mapped path_offsets (not 4 bytes a record of offsets found by
    # scanning the path table); a shuffled LMDB or HDF5 pack: each record's position from
    # the mapped positions table (not the inverse of order, 4 bytes a record, and a byte a
    # record to check order).
    found = {}
    for records in SIZES:
        good, *found[records] = in_worker(TracedReads(packs[fmt, shuffled, records]))
        assert good == READS * 2
    for what, k in (("kept", 0), ("peak", 1)):
        grown = found[SIZES[1]][k] - found[SIZES[0]][k]
        assert grown < PER_RECORD * (SIZES[1] - SIZES[0]), f"the worker's {what} grew by {grown} bytes: {found}"


class TracedOrderCheck(torch.utils.data.IterableDataset):
    """In a DataLoader worker: the pack's stored order checked a permutation (a block sampler's
    storage_order(); a WebDataset pack's checked_order, what check_tables runs on order.bin,
    whose storage_order() checks each shard's run as a stream first reads it): yields
    (the order's length, the most its check held at once)."""

    def __init__(self, path: str, fmt: str):
        self.path, self.fmt = path, fmt

    def __iter__(self):
        reader = open_reader(self.path)
        reader.open()
        tracemalloc.start()
        order = reader.checked_order(reader.read_order()) if self.fmt == "wds" else reader.storage_order()
        yield len(order), tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        reader.close()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_checking_a_stored_order_holds_nothing_per_record(packs, fmt):
    # positions[order[i]] == i for every i proves order a permutation: no byte a record of scratch.
    peaks = {}
    for records in SIZES:
        loader = torch.utils.data.DataLoader(TracedOrderCheck(packs[fmt, True, records], fmt), batch_size=None,
                                             num_workers=1, multiprocessing_context="fork")
        count, peaks[records] = next(iter(loader))
        assert count == records
    grown = peaks[SIZES[1]] - peaks[SIZES[0]]
    assert grown < PER_RECORD / 4 * (SIZES[1] - SIZES[0]), f"checking order grew the peak by {grown} bytes: {peaks}"


def test_the_stored_positions_are_the_inverse_of_the_order_a_window_at_a_time():
    order = np.random.default_rng(3).permutation(10_000).astype(np.int32)
    chunks = list(inverse_chunks(order, window=1_024))
    assert len(chunks) == 10
    positions = np.concatenate(chunks)
    assert (positions[order] == np.arange(10_000)).all()


def rewrite_lmdb(path: str, key: str, value: bytes | None, crc: bool = True) -> None:
    """Put (or with None delete) key train/<key> of an LMDB pack; with crc, its checksum to
    match (or removed with it), as a pack written that way would hold."""
    env = lmdb.open(path, map_size=1 << 30, subdir=True, lock=False)
    with env.begin(write=True) as txn:
        crcs = json.loads(txn.get(b"train/checksums"))
        if value is None:
            txn.delete(f"train/{key}".encode())
            crcs.pop(key, None)
        else:
            txn.put(f"train/{key}".encode(), value)
            if crc:
                crcs[key] = zlib.crc32(value)
        txn.put(b"train/checksums", json.dumps(crcs).encode())
    env.close()


def read_all(path: str) -> list[tuple]:
    reader = open_reader(path)
    try:
        return [reader.read(i) for i in range(len(reader))]
    finally:
        reader.close()


def reads_as_before(out: str, expected: list, removed) -> None:
    """A pack whose index tables `removed` were taken out, as an older packer wrote it: the
    reader finds neither of those, still checks its tables, and reads every record as before."""
    reader = open_reader(out)
    try:
        assert (reader.path_index() is False) == ("path_offsets" in removed)
        assert (reader.stored_positions() is None) == ("positions" in removed)
        reader.check_tables()
    finally:
        reader.close()
    assert read_all(out) == expected


@pytest.mark.parametrize("shuffled", [False, True])
def test_an_lmdb_pack_written_before_the_index_tables_reads_the_same(tmp_path, shuffled):
    out = write_pack(str(tmp_path / "p.lmdb"), 3_000, "lmdb", shuffled)
    expected = read_all(out)
    rewrite_lmdb(out, "path_offsets", None)
    if shuffled:
        rewrite_lmdb(out, "positions", None)
    reads_as_before(out, expected, ("path_offsets", "positions"))  # an unshuffled pack has no positions


@pytest.mark.parametrize("tables", [("positions",), ("path_offsets",), ("positions", "path_offsets")])
def test_an_hdf5_pack_written_before_the_index_tables_reads_the_same(tmp_path, tables):
    out = write_pack(str(tmp_path / "p.h5"), 3_000, "hdf5", True)
    expected = read_all(out)
    with h5py.File(out, "r+") as f:
        crcs = json.loads(f["train"].attrs["checksums"])
        for table in tables:
            del f["train"][table], crcs[table]
        f["train"].attrs["checksums"] = json.dumps(crcs)
    reads_as_before(out, expected, tables)


@pytest.mark.parametrize("tables", [("path_offsets",), ("positions",), ("path_offsets", "positions")])
def test_a_wds_pack_written_before_path_offsets_or_positions_reads_the_same(tmp_path, tables):
    out = write_pack(str(tmp_path / "p.wds"), 3_000, "wds", True)
    expected = read_all(out)
    index_file = tmp_path / "p.wds" / "index.json"
    index = json.loads(index_file.read_text())
    entry = index["wds"]["splits"]["train"]
    for table in tables:
        (tmp_path / "p.wds" / entry.pop(table)).unlink()
        del entry[f"{table}_crc32"]
    index_file.write_text(json.dumps(index))
    reads_as_before(out, expected, tables)


def damaged(path: str, match: str, check_tables: bool = False) -> None:
    reader = open_reader(path)
    try:
        with pytest.raises(CorruptDataError, match=match) as caught:
            if check_tables:
                reader.check_tables()
            else:
                for i in range(len(reader)):
                    reader.read(i)
    finally:
        reader.close()
    assert path in str(caught.value)


def test_damaged_path_offsets_are_named(tmp_path):
    out = write_pack(str(tmp_path / "p.lmdb"), 3_000, "lmdb", False)
    with lmdb.open(out, readonly=True, lock=False) as env, env.begin() as txn:
        offsets = np.frombuffer(txn.get(b"train/path_offsets"), "<u8").copy()
    flipped = offsets.copy()
    flipped[1500] += 1
    rewrite_lmdb(out, "path_offsets", flipped.tobytes(), crc=False)
    damaged(out, r"key train/path_offsets: checksum mismatch")
    rewrite_lmdb(out, "path_offsets", flipped.tobytes())  # its CRC-32 made to match: the block check finds it
    damaged(out, r"train/path_offsets: entries 1024\.\.2048 are not where the path table's paths start")
    rewrite_lmdb(out, "path_offsets", offsets[:-1].tobytes())
    damaged(out, r"train/path_offsets: holds 3000 entries, the metadata says 3001")
    rewrite_lmdb(out, "path_offsets", offsets.tobytes()[:-3])
    damaged(out, r"train/path_offsets: 24005 bytes, not a whole number of 8-byte entries")
    rewrite_lmdb(out, "path_offsets", offsets.tobytes())
    read_all(out)


@pytest.mark.parametrize("fmt", ["hdf5", "wds"])
def test_damaged_path_offsets_of_hdf5_and_wds_are_named(tmp_path, fmt):
    out = write_pack(str(tmp_path / f"p.{fmt}"), 3_000, fmt, True)
    if fmt == "hdf5":
        with h5py.File(out, "r+") as f:
            f["train"]["path_offsets"][1500] += 1
        where = r"dataset train/path_offsets"
    else:
        table = tmp_path / "p.wds" / "train" / "path_offsets.bin"
        offsets = np.fromfile(table, "<u8")
        offsets[1500] += 1
        offsets.tofile(table)
        where = r"train/path_offsets\.bin"
    damaged(out, where + ": checksum mismatch")


@pytest.mark.parametrize("positions", [True, False])
def test_a_duplicate_in_the_order_table_is_caught(tmp_path, positions):
    # With positions stored, positions[order[i]] == i fails for the duplicate (check_tables may
    # meet it first as positions not inverting order); without, the bitmap finds a record missing.
    out = write_pack(str(tmp_path / "p.lmdb"), 3_000, "lmdb", True)
    with lmdb.open(out, readonly=True, lock=False) as env, env.begin() as txn:
        order = np.frombuffer(txn.get(b"train/order"), "<i4").copy()
    order[2000] = order[10]
    rewrite_lmdb(out, "order", order.tobytes())
    if not positions:
        rewrite_lmdb(out, "positions", None)
    damaged(out, r"the train order table is not a permutation of 3000 records"
            + (r"|train/positions: entries \d+\.\.\d+ are not the inverse of the order table" if positions else ""),
            check_tables=True)
    reader = open_reader(out)
    with pytest.raises(CorruptDataError, match="not a permutation"):
        reader.storage_order()  # what a block sampler asks for
    reader.close()


def test_damaged_positions_are_named(tmp_path):
    out = write_pack(str(tmp_path / "p.lmdb"), 3_000, "lmdb", True)
    with lmdb.open(out, readonly=True, lock=False) as env, env.begin() as txn:
        positions = np.frombuffer(txn.get(b"train/positions"), "<i4").copy()
    bad = positions.copy()
    bad[2500] = 3_000
    rewrite_lmdb(out, "positions", bad.tobytes())
    damaged(out, r"train/positions: entries 2048\.\.3000 name positions outside 0\.\.2999")
    bad = positions.copy()
    bad[[10, 20]] = bad[[20, 10]]
    rewrite_lmdb(out, "positions", bad.tobytes())
    damaged(out, r"train/positions: entries 0\.\.1024 are not the inverse of the order table")
    plain = write_pack(str(tmp_path / "plain.lmdb"), 3_000, "lmdb", False)
    rewrite_lmdb(plain, "positions", positions.tobytes())
    damaged(plain, r"train/positions: a positions table in a split stored in index order")


def rewrite_wds_positions(out: str, positions: np.ndarray | None, crc: bool = True, order: bool = True) -> None:
    """positions.bin replaced by positions (its CRC-32 in index.json made to match unless crc is
    False); order False drops order.bin from the index."""
    index_file = f"{out}/index.json"
    with open(index_file) as f:
        index = json.load(f)
    entry = index["wds"]["splits"]["train"]
    if positions is not None:
        raw = positions.tobytes()
        with open(f"{out}/train/positions.bin", "wb") as f:
            f.write(raw)
        entry["positions_crc32"] = zlib.crc32(raw) if crc else entry["positions_crc32"]
    if not order:
        del entry["order"], entry["order_crc32"]
    with open(index_file, "w") as f:
        json.dump(index, f)


def test_damaged_wds_positions_are_named(tmp_path):
    out = write_pack(str(tmp_path / "p.wds"), 3_000, "wds", True)
    positions = np.fromfile(f"{out}/train/positions.bin", "<i4")
    where = r"train/positions\.bin"
    bad = positions.copy()
    bad[2500] = 3_000
    rewrite_wds_positions(out, bad, crc=False)
    damaged(out, where + r": checksum mismatch", check_tables=True)
    rewrite_wds_positions(out, bad)
    damaged(out, where + r": entries \d+\.\.\d+ name positions outside 0\.\.2999", check_tables=True)
    bad = positions.copy()
    bad[[10, 20]] = bad[[20, 10]]
    rewrite_wds_positions(out, bad)
    damaged(out, where + r": entries \d+\.\.\d+ are not the inverse of the order table", check_tables=True)
    rewrite_wds_positions(out, positions[:-1])
    damaged(out, where + r".*(holds|bytes)", check_tables=True)
    rewrite_wds_positions(out, positions)
    reader = open_reader(out)
    reader.check_tables()
    reader.close()
    rewrite_wds_positions(out, None, order=False)
    damaged(out, where + r": a positions table in a split stored in index order", check_tables=True)


def test_a_damaged_mapped_table_past_the_open_check_fails_check_tables(tmp_path, monkeypatch):
    # Past CRC_AT_OPEN a table's CRC-32 is left to check_tables (packer verify): a label that
    # passes its block's range check is caught by the record's header (a read through the
    # map), and the whole table's CRC-32 names the table.
    from packer.formats import _tables
    out = write_pack(str(tmp_path / "p.lmdb"), 3_000, "lmdb", False)
    with lmdb.open(out, readonly=True, lock=False) as env, env.begin() as txn:
        labels = np.frombuffer(txn.get(b"train/labels"), "<i4").copy()
    labels[7] = (labels[7] + 1) % CLASSES
    rewrite_lmdb(out, "labels", labels.tobytes(), crc=False)
    monkeypatch.setattr(_tables, "CRC_AT_OPEN", 0)
    reader = open_reader(out).open()
    assert reader.read(6)[1] == labels[6]
    with pytest.raises(CorruptDataError, match=r"record train/7: the record's header says label 0, .* the tables say 1"):
        reader.read(7)
    with pytest.raises(CorruptDataError, match=r"key train/labels: checksum mismatch"):
        reader.check_tables()
    reader.close()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_a_datasets_paths_index_and_pickle_like_a_list(packs, fmt):
    dataset = readers.open_dataset(packs[fmt, True, SIZES[0]], decode="raw")
    names = names_of(SIZES[0])[1]
    assert type(dataset.paths).__name__ == "PathIndex"
    assert list(dataset.paths) == names and dataset.paths[-1] == names[-1]
    with pytest.raises(IndexError):
        dataset.paths[SIZES[0]]
    assert list(pickle.loads(pickle.dumps(dataset.paths))) == names
    dataset.close()


def test_lmdb_tables_put_while_their_pages_are_dropped_are_whole(tmp_path, monkeypatch):
    # Every table counts as large and the pages are dropped as often as the thread can: the
    # tables' CRC-32s (taken from the sources) and every record read back prove each copy whole.
    from packer.formats import lmdb as lmdb_format
    monkeypatch.setattr(lmdb_format, "TXN_BYTES", 16 << 10)
    monkeypatch.setattr(lmdb_format, "RELEASE_EVERY", 1e-4)
    out = write_pack(str(tmp_path / "p.lmdb"), 20_000, "lmdb", True)
    reader = open_reader(out)
    reader.check_tables()
    assert [reader.read(i)[2] for i in range(0, 20_000, 997)] == [names_of(20_000)[1][i] for i in range(0, 20_000, 997)]
    reader.close()
