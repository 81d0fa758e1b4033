"""Damaged, hostile and replaced datasets, on real crafted files: every damage is reported
as the project's error, never read as wrong labels, paths or bytes, never a crash.

PACKER_FUZZ_CASES sets how many bytes the table byte-flip trial flips per format
(default 8; thousands for a report).
"""
from __future__ import annotations

import json
import re
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Callable

import h5py
import lmdb
import numpy as np
import pytest
from torch.utils.data import DataLoader

import readers
from packer import FORMATS, open_reader, pack
from packer.convert import convert
from packer.errors import CorruptDataError, PackError
from packer.formats import read_metadata
from packer.formats import wds as wds_format
from packer.records import metadata_crc
from packer.verify import verify

from conftest import class_sorted_tree, jpeg_bytes, write

REPO = Path(__file__).resolve().parents[1]
FUZZ_CASES = int(os.environ.get("PACKER_FUZZ_CASES", "8"))


def packed(tmp_path: Path, fmt: str, src: Path | None = None, name: str = "p", **kwargs) -> Path:
    src = src or class_sorted_tree(tmp_path / "src", classes=3, per_class=5)
    out = tmp_path / f"{name}{FORMATS[fmt].extension}"
    pack(str(src), fmt, str(out), workers=1, progress=False, **kwargs)
    return out


def read_everything(path: Path, check_crc: bool = True) -> list:
    """Every record of every split, with the tables a Dataset uses."""
    everything = []
    for split in read_metadata(str(path)).splits:
        reader = open_reader(path, split, check_crc=check_crc)
        try:
            everything += [(reader.read(i), reader.labels[i], reader.paths[i]) for i in range(len(reader))]
        finally:
            reader.close()
    return everything


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter importing this checkout's packer (a crash shows as a negative code)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def in_fork(call: Callable[[], object]) -> tuple[str, int]:
    """What call() does in a forked child: "ok" or the error it raised ("Type: message"), and
    the child's wait status (0, or the signal that killed it, SIGBUS say, with no message)."""
    read, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                call()
                message = "ok"
            except BaseException as exc:  # any outcome is reported to the parent
                message = f"{type(exc).__name__}: {exc}"
            os.write(write_end, message.encode()[:60000])
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode()
    return message, os.waitpid(pid, 0)[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_python("from packer.cli import main; main()", *args)


# Case 10: a truncated data.mdb is an error, not SIGBUS -----------------------------------------

TRUNCATED_AT = {
    "empty": lambda size: 0,
    "meta pages": lambda size: 4096 + 100,
    "records": lambda size: size // 2,
    "B-tree": lambda size: size - 4096 + 16,  # the last page: tables, metadata, the B-tree root
}


@pytest.mark.parametrize("cut", TRUNCATED_AT)
def test_truncated_lmdb_is_an_error_for_every_command_not_sigbus(tmp_path, cut):
    out = packed(tmp_path, "lmdb")
    data = out / "data.mdb"
    os.truncate(data, TRUNCATED_AT[cut](data.stat().st_size))
    runs = [run_cli("info", str(out)), run_cli("verify", str(out), "--workers", "1"),
            run_cli("convert", str(out), "--to", "hdf5", "-o", str(tmp_path / "c.h5"), "--workers", "1"),
            run_python("import sys; from packer import open_reader; open_reader(sys.argv[1]).read(0)", str(out))]
    for result in runs:
        assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
        assert f"{data}: truncated: " in result.stderr and "restore it from a copy or re-pack" in result.stderr
    assert not (tmp_path / "c.h5").exists()


def test_a_record_cut_off_while_a_reader_has_it_open_is_an_error_not_a_map_read(tmp_path):
    """The short pread used to drop the extents as stale and read through LMDB's map, past
    the new end of data.mdb: SIGBUS. This pack's tables are small enough to be copied, so
    nothing else here touches a cut page."""
    out = packed(tmp_path, "lmdb")
    code = ("import os, sys\n"
            "from packer import open_reader\n"
            "r = open_reader(sys.argv[1]); r.read(0)\n"
            "data = os.path.join(sys.argv[1], 'data.mdb'); os.truncate(data, os.path.getsize(data) // 2)\n"
            "r.read(len(r) - 1)\n")
    result = run_python(code, str(out))
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert re.search(r"data\.mdb: truncated while in use: \d+ bytes, \d+ when this Dataset was made; restore it "
                     r"from a copy or re-pack, then restart the DataLoader", result.stderr)
    assert "rewritten by another tool" not in result.stderr


@pytest.fixture(scope="module")
def large_tables(tmp_path_factory) -> Path:
    """1,200 tiny records packed as LMDB and HDF5, once: each test cuts a copy of its own."""
    root = tmp_path_factory.mktemp("large-tables")
    for i in range(1200):
        write(root / "src" / f"c{i % 2}" / f"{i:04d}.jpg", jpeg_bytes(i % 7, size=(8, 8)))
    for fmt in ("lmdb", "hdf5"):
        packed(root, fmt, root / "src")
    return root


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
@pytest.mark.parametrize("before, after", [
    (lambda ds: ds.__getitems__(list(range(64))), lambda ds: ds.__getitems__(list(range(len(ds) - 64, len(ds))))),
    (lambda ds: ds[0], lambda ds: ds[len(ds) - 1]),  # a lone item: an evaluation loop, a notebook
], ids=["batch", "item"])
def test_a_file_cut_short_under_a_dataset_is_an_error_not_sigbus(large_tables, tmp_path, fmt, before, after):
    """1,200 records: tables large enough to be mapped from the file, so a read after the cut
    would touch a page past its end. A batch (__getitems__, what DataLoader calls) and a lone
    ds[i] check the file's size before their records' tables are read. In a forked child, so
    that a SIGBUS would kill it, not the tests; the Dataset is made there, after the fork."""
    pristine = large_tables / f"p{FORMATS[fmt].extension}"
    out = tmp_path / pristine.name
    (shutil.copytree if pristine.is_dir() else shutil.copy2)(pristine, out)
    data = out / "data.mdb" if fmt == "lmdb" else out

    def cut_under_a_dataset():
        ds = {"lmdb": readers.LMDBDataset, "hdf5": readers.HDF5Dataset}[fmt](str(out), decode="raw")
        before(ds)
        os.truncate(data, os.path.getsize(data) // 2)
        after(ds)

    message, status = in_fork(cut_under_a_dataset)
    assert status == 0, f"the child died: wait status {status}"
    assert re.search(rf"{re.escape(str(data))}: truncated while in use: \d+ bytes, \d+ when this Dataset was made",
                     message), message


# Case 12: every table is range-checked when it loads ---------------------------------------------

def lmdb_put(out: Path, key: str, value: bytes | None, split: str = "all", checksum: bool = True) -> None:
    """Rewrite (or delete, value None) one key of a packed LMDB; with checksum, update the
    stored table checksum too, as a careful forger would."""
    env = lmdb.open(str(out), map_size=os.path.getsize(out / "data.mdb") + (1 << 20), lock=False)
    with env.begin(write=True) as txn:
        if value is None:
            txn.delete(f"{split}/{key}".encode())
        else:
            txn.put(f"{split}/{key}".encode(), value)
        if checksum and value is not None:
            crcs = json.loads(txn.get(f"{split}/checksums".encode()))
            crcs[key] = zlib.crc32(value)
            txn.put(f"{split}/checksums".encode(), json.dumps(crcs).encode())
    env.close()


def wds_rewrite(out: Path, table: str, raw: bytes) -> None:
    """Rewrite records.bin or paths.bin, and its checksum in index.json."""
    (out / "all" / f"{table}.bin").write_bytes(raw)
    index = json.loads((out / "index.json").read_text())
    index["wds"]["splits"]["all"][f"{table}_crc32"] = zlib.crc32(raw)
    (out / "index.json").write_text(json.dumps(index))


def assert_reads_fail(out: Path, match: str, reads: int = 2) -> None:
    """Every read (not only the first) raises CorruptDataError matching match."""
    reader = open_reader(out)
    for _ in range(reads):
        with pytest.raises(CorruptDataError, match=match):
            reader.read(0)
            reader.labels, reader.paths
    reader.close()


@pytest.mark.parametrize("forged_metadata", [True, False])
def test_sparse_hdf5_images_are_refused_without_reading_them(tmp_path, forged_metadata):
    # A 2 GiB images dataset in a file of a few KB: HDF5 would make up 2 GiB of zeros.
    out = packed(tmp_path, "hdf5")
    with h5py.File(out, "r+", locking=False) as f:
        if forged_metadata:  # the split's byte count made to agree
            meta = json.loads(f.attrs["packer_metadata"])
            meta["splits"]["all"]["bytes"] = meta["bytes"] = 2 << 30
            meta["crc32"] = metadata_crc(meta)  # the forger recomputes the metadata checksum too
            f.attrs["packer_metadata"] = json.dumps(meta)
        g = f["all"]
        g["images"].resize((2 << 30,))
        offsets = g["offsets"][()]
        offsets[-1] = 2 << 30
        g["offsets"][-1] = 2 << 30
        crcs = json.loads(g.attrs["checksums"])
        crcs["offsets"] = zlib.crc32(offsets.astype("<i8").tobytes())
        g.attrs["checksums"] = json.dumps(crcs)
    assert out.stat().st_size < 10 << 20
    # In a process allowed far less memory than the record: refused before any read.
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30));"
            "from packer import open_reader; r = open_reader(sys.argv[1]); r.read(len(r) - 1)")
    result = run_python(code, str(out))
    assert result.returncode == 1, result.stderr[-2000:]
    message = ("all/images: 2147483648 bytes, of which the file stores only part" if forged_metadata else
               "all/images: 2147483648 bytes, the metadata says the split's images take")
    assert message in result.stderr
    report = verify(str(out), workers=1)
    assert report.problems and all(message in p for p in report.problems)


@pytest.mark.parametrize("field,value,match", [
    ("size", 1 << 40, "record 3 lies at bytes"),
    ("size", 1 << 63, "record 3 lies at bytes"),
    ("offset", (1 << 64) - 8, "record 3 lies at bytes"),
    ("shard", 7, "a record names shard 7, the split has 1"),
    ("label", 6684776, r"labels range over \[0, 6684776\]"),
])
def test_wds_records_out_of_range_are_refused(tmp_path, field, value, match):
    out = packed(tmp_path, "wds")
    records = np.fromfile(out / "all" / "records.bin", wds_format.RECORD)
    records[3][field] = value
    wds_rewrite(out, "records", records.tobytes())
    assert_reads_fail(out, f"records.bin: {match}")
    with pytest.raises(CorruptDataError, match=match):  # not a MemoryError blamed on the disk
        convert(str(out), "lmdb", str(tmp_path / "c.lmdb"), workers=1, progress=False)


def test_short_wds_paths_table_is_refused(tmp_path):
    out = packed(tmp_path, "wds")
    raw = (out / "all" / "paths.bin").read_bytes()
    wds_rewrite(out, "paths", raw[:raw.rindex(b"\0")])  # one path fewer
    # A read looks its path up through path_offsets, which no longer fits the table; the
    # whole table (Reader.paths) is one path short.
    assert_reads_fail(out, r"path_offsets\.bin: does not describe the \d+-byte path table|"
                           "paths.bin: holds 14 paths, the metadata says 15")


@pytest.mark.parametrize("checksums", [True, False])
def test_deleted_lmdb_paths_key_fails_every_read_clearly(tmp_path, checksums):
    out = packed(tmp_path, "lmdb")
    if not checksums:
        lmdb_put(out, "checksums", None)
    lmdb_put(out, "paths", None)
    assert_reads_fail(out, "key all/paths: key missing", reads=3)  # never AttributeError


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_labels_out_of_range_are_refused(tmp_path, fmt):
    out = packed(tmp_path, fmt)
    labels = np.zeros(15, "<i4")
    labels[4] = 6684776
    if fmt == "lmdb":
        lmdb_put(out, "labels", labels.tobytes())
    elif fmt == "hdf5":
        with h5py.File(out, "r+", locking=False) as f:
            f["all/labels"][...] = labels
            crcs = json.loads(f["all"].attrs["checksums"])
            crcs["labels"] = zlib.crc32(labels.tobytes())
            f["all"].attrs["checksums"] = json.dumps(crcs)
    else:
        records = np.fromfile(out / "all" / "records.bin", wds_format.RECORD)
        records["label"] = labels
        wds_rewrite(out, "records", records.tobytes())
    assert_reads_fail(out, r"labels range over \[0, 6684776\], the dataset has 3 classes")


def test_lmdb_extents_past_the_file_are_refused(tmp_path):
    out = packed(tmp_path, "lmdb")
    reader = open_reader(out)
    extents = reader.extents().copy()
    reader.close()
    extents[2]["offset"] = 1 << 40
    lmdb_put(out, "extents", extents.tobytes())
    assert_reads_fail(out, "all/extents: extent 2 lies at bytes")


def test_lmdb_record_read_through_the_map_is_checked_against_the_tables(tmp_path):
    # Records small enough to live in B-tree pages have no extent: their header's label and
    # path are checked against the tables as they are read.
    src = tmp_path / "src"
    for i in range(6):
        write(src / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(i, size=(8, 8)))
    out = packed(tmp_path, "lmdb", src)
    labels = np.array([1, 1, 0, 1, 0, 1], "<i4")  # 0 and 1 trade labels
    lmdb_put(out, "labels", labels.tobytes())
    reader = open_reader(out)
    with pytest.raises(CorruptDataError, match="record's header says label 0, path 'c0/0.jpg'; the tables say 1"):
        reader.read(0)
    reader.close()


# Case 14: tables carry checksums; a flipped byte is always reported -------------------------------

def table_spans(out: Path, fmt: str) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of every per-record table of a packed dataset, as stored."""
    if fmt == "wds":
        return [(out / "all" / name, 0, (out / "all" / name).stat().st_size)
                for name in ("records.bin", "paths.bin", "path_offsets.bin", "order.bin", "positions.bin")]
    if fmt == "lmdb":
        env = lmdb.open(str(out), readonly=True, lock=False)
        with env.begin() as txn:
            raws = [bytes(txn.get(f"all/{name}".encode())) for name in ("labels", "paths", "extents", "order",
                                                                               "positions", "path_offsets")
                    if txn.get(f"all/{name}".encode()) is not None]
        env.close()
        where = out / "data.mdb"
    else:
        with h5py.File(out, "r", locking=False) as f:
            raws = [f["all"][name][()].tobytes() for name in ("offsets", "crc32", "labels", "paths", "order",
                                                                    "positions") if name in f["all"]]
        where = out
    data = where.read_bytes()
    spans = []
    for raw in raws:
        assert data.count(raw) == 1  # found where it is stored, and only there
        spans.append((where, data.index(raw), len(raw)))
    return spans


# A WebDataset pack's map-style reads find a sample through records.bin alone: its storage order
# and that order's inverse are a stream's and check_tables'.
STREAM_TABLES = {"order.bin", "positions.bin"}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_flipped_table_byte_is_reported_by_readers_and_verify(tmp_path, fmt):
    out = packed(tmp_path, fmt, shuffle=True, shuffle_seed=5)
    spans = table_spans(out, fmt)
    probe = open_reader(out)
    assert probe.tables_checked
    probe.close()
    rng = np.random.default_rng(14)
    for case in range(max(FUZZ_CASES, len(spans))):
        where, offset, length = spans[case % len(spans)]  # every table in turn
        at = int(rng.integers(length))
        original = where.read_bytes()
        flipped = bytearray(original)
        flipped[offset + at] ^= 1 << int(rng.integers(8))
        where.write_bytes(bytes(flipped))
        try:
            # Reads check the blocks they use (ranges) and each record's own checksum; the
            # tables' CRC-32s are checked whole by check_tables, as verify does.
            if where.name not in STREAM_TABLES:
                with pytest.raises(CorruptDataError, match="damaged"):
                    read_everything(out)
            reader = open_reader(out)
            with pytest.raises(CorruptDataError, match="checksum mismatch, the table is damaged"):
                reader.check_tables()
            reader.close()
            report = verify(str(out), workers=1)
            assert report.problems and all("checksum mismatch" in p for p in report.problems), (case, report)
        finally:
            where.write_bytes(original)
    assert not verify(str(out), workers=1).problems


def strip_table_checksums(out: Path, fmt: str) -> None:
    """Make out what a packer from before table checksums wrote."""
    if fmt == "lmdb":
        lmdb_put(out, "checksums", None)
    elif fmt == "hdf5":
        with h5py.File(out, "r+", locking=False) as f:
            del f["all"].attrs["checksums"]
    else:
        index = json.loads((out / "index.json").read_text())
        for entry in index["wds"]["splits"].values():
            del entry["records_crc32"], entry["paths_crc32"]
            for table in ("order", "path_offsets", "positions"):  # all came after table checksums
                if entry.pop(table, None):
                    del entry[f"{table}_crc32"]
                    (out / "all" / f"{table}.bin").unlink()
        (out / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_packs_without_table_checksums_still_read(tmp_path, fmt):
    src = class_sorted_tree(tmp_path / "src", classes=3, per_class=5)
    out = packed(tmp_path, fmt, src, shuffle=True, shuffle_seed=5)
    expected = read_everything(out)
    strip_table_checksums(out, fmt)
    reader = open_reader(out)
    assert not reader.tables_checked
    reader.close()
    assert read_everything(out) == expected
    assert [(src / path).read_bytes() for _, _, path in expected] == [record[0][0] for record in expected]
    report = verify(str(out), workers=1)
    assert report.ok and any("tables not covered by checksums" in note for note in report.notes)
    (tmp_path / "new").mkdir()
    assert not any("checksums" in note for note in verify(str(packed(tmp_path / "new", fmt, src)), workers=1).notes)


def test_wds_sample_json_carries_the_label(tmp_path):
    import tarfile
    out = packed(tmp_path, "wds")
    reader = open_reader(out)
    with tarfile.open(out / reader.shards[0]) as tar:
        metas = {m.name: json.loads(tar.extractfile(m).read()) for m in tar if m.name.endswith(".json")}
    by_path = {meta["path"]: meta for meta in metas.values()}
    for i in range(len(reader)):
        assert by_path[reader.paths[i]]["label"] == reader.labels[i]
    kind = reader.metadata.checksum  # the member names the record checksum kind, keys sorted
    assert kind == "xxh3" and all(list(meta) == ["label", "path", "xxh3"] for meta in metas.values())


# Case 16: a dataset replaced while in use (pack --force) ----------------------------------------

def two_trees(tmp_path: Path) -> tuple[Path, Path]:
    """Two sources with the same file names but other images and other labels."""
    old, new = tmp_path / "old", tmp_path / "new"
    for i in range(8):
        write(old / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(i, size=(96, 80)))
        write(new / f"c{(i + 1) % 2}" / f"{i}.jpg", jpeg_bytes(100 + i, size=(96, 80)))
    write(new / "c2" / "extra.jpg", jpeg_bytes(999, size=(96, 80)))
    return old, new


def records_of(reader) -> list:
    return [reader.read(i) for i in range(len(reader))]


def read_in_fork(reader) -> str:
    """What reading record 0 does in a forked child: "ok" or the error's message."""
    return in_fork(lambda: reader.read(0))[0]


def read_first(reader) -> str:
    try:
        reader.read(0)
        return "ok"
    except PackError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def spawned():
    """One spawned process that the formats' tests share: each spawn imports torch, seconds."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        yield pool


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_dataset_replaced_in_use_is_never_mixed_with_the_old_one(tmp_path, fmt, spawned):
    old_src, new_src = two_trees(tmp_path)
    out = tmp_path / f"d{FORMATS[fmt].extension}"
    pack(str(old_src), fmt, str(out), workers=1, progress=False)
    before = open_reader(out).open()
    unopened = open_reader(out)  # created before, first opened after
    old = records_of(before)
    pack(str(new_src), fmt, str(out), workers=1, progress=False, force=True)
    # A reader open before keeps reading the old dataset, whole.
    assert records_of(before) == old
    # A reader created after, in the same process, reads the new one, whole: no stale
    # handle or table of the old file is reused (with or without CRC checks).
    for check_crc in (True, False):
        after = open_reader(out, check_crc=check_crc)
        assert len(after) == 9 and after.classes == ["c0", "c1", "c2"]
        for data, label, path in records_of(after):
            assert data == (new_src / f"c{label}" / path.split("/")[1]).read_bytes() and path.startswith(f"c{label}/")
        after.close()
    # Anywhere the old reader opens afresh (a forked or spawned worker, or first use), it refuses.
    replaced = "was replaced since this Dataset was created"
    assert replaced in read_in_fork(before)
    assert replaced in read_first(pickle.loads(pickle.dumps(before)))
    assert replaced in read_first(unopened)
    assert replaced in spawned.apply(read_first, (before,))
    before.close()


def test_dataloader_workers_of_a_replaced_lmdb_dataset_refuse_to_read(tmp_path):
    old_src, new_src = two_trees(tmp_path)
    out = tmp_path / "d.lmdb"
    pack(str(old_src), "lmdb", str(out), workers=1, progress=False)
    ds = readers.LMDBDataset(out, decode="raw")
    loader = DataLoader(ds, batch_size=4, num_workers=1, collate_fn=lambda batch: batch,
                        multiprocessing_context="fork")
    assert [label for batch in loader for _, label in batch] == ds.targets.tolist()
    pack(str(new_src), "lmdb", str(out), workers=1, progress=False, force=True)
    with pytest.raises(CorruptDataError, match="data.mdb was replaced since this Dataset was created"):
        list(loader)  # non-persistent workers open afresh: never the new labels under the old classes
    ds.close()
