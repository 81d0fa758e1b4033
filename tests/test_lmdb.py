"""The LMDB layout as documented in the README, read with the lmdb package alone."""
from __future__ import annotations

import json
import os
import random
import struct
import warnings
import zlib

import lmdb
import numpy as np
import pytest
import xxhash

import readers
from packer import pack
from packer.errors import CorruptDataError
from packer.formats import lmdb as lmdb_format

from conftest import class_sorted_tree, jpeg_bytes, write


# Each record checksum kind as another tool computes it, and the format version it is written with.
KINDS = {"crc32": (zlib.crc32, 1), "xxh3": (lambda b: xxhash.xxh3_64_intdigest(b) & 0xFFFFFFFF, 2)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layout_is_readable_with_lmdb_and_json_alone(split_tree, tmp_path, kind):
    out = tmp_path / "s.lmdb"
    pack(str(split_tree), "lmdb", str(out), progress=False, checksum=kind)
    record_sum, version = KINDS[kind]
    assert sorted(os.listdir(out)) == ["data.mdb"]  # no lock file: read-only data, lock=False
    env = lmdb.open(str(out), readonly=True, lock=False)
    accounted = 0
    with env.begin() as txn:
        meta = json.loads(txn.get(b"__meta__"))
        accounted += 1
        assert meta["format"] == "lmdb" and meta["format_version"] == version
        assert meta.get("checksum", "crc32") == kind and ("checksum" in meta) == (kind != "crc32")
        for split, info in meta["splits"].items():
            labels = np.frombuffer(txn.get(f"{split}/labels".encode()), "<i4")
            paths = txn.get(f"{split}/paths".encode()).decode().split("\0")
            extents = np.frombuffer(txn.get(f"{split}/extents".encode()), [("offset", "<u8"), ("length", "<u4")])
            sums = np.frombuffer(txn.get(f"{split}/sums".encode()), "<u4")
            checksums = json.loads(txn.get(f"{split}/checksums".encode()))
            blob = bytes(txn.get(f"{split}/paths".encode()))
            offsets = np.frombuffer(txn.get(f"{split}/path_offsets".encode()), "<u8")
            accounted += 6
            assert len(labels) == len(paths) == len(extents) == len(sums) == len(offsets) - 1 == info["count"]
            assert [blob[a:b - 1].decode() for a, b in zip(offsets[:-1], offsets[1:])] == paths
            assert sorted(checksums) == ["extents", "labels", "path_offsets", "paths", "sums"]
            for table, crc in checksums.items():
                assert zlib.crc32(txn.get(f"{split}/{table}".encode())) == crc
            for i in range(info["count"]):
                value = txn.get(b"%s/%010d" % (split.encode(), i))
                crc, label, n = struct.unpack_from("<IiH", value)
                relpath = value[10:10 + n].decode()
                image = value[10 + n:]
                accounted += 1
                assert record_sum(image) == crc == sums[i]
                assert (label, relpath) == (labels[i], paths[i])
                assert image == (split_tree / relpath).read_bytes()
                assert meta["classes"][label] == relpath.split("/")[1]
                offset, length = extents[i].tolist()
                if length:  # where LMDB put the value in data.mdb, readable without LMDB
                    with open(out / "data.mdb", "rb") as f:
                        f.seek(offset)
                        assert f.read(length) == bytes(value)
                else:  # only values small enough to sit inside B-tree pages have none
                    assert len(value) < lmdb_format.EXTENT_MIN
        # Every key is one of the documented ones: nothing else (no pickles) is stored.
        assert txn.stat()["entries"] == accounted


HAS_EXTENTS = lmdb_format.WRITEMAP and os.path.exists("/proc/self/maps")


@pytest.mark.skipif(not HAS_EXTENTS, reason="extents are taken from the writemap mapping (Linux)")
def test_records_are_read_at_their_extents_and_stale_extents_fall_back(tmp_path):
    src = tmp_path / "src"
    for i in range(6):
        write(src / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(i, size=(160, 120)))  # > a page each
    out = tmp_path / "big.lmdb"
    pack(str(src), "lmdb", str(out), progress=False)
    reader = lmdb_format.Reader(str(out))
    extents = reader.extents()
    assert extents is not None and extents["length"].all()
    with open(out / "data.mdb", "rb") as f:
        for i in range(6):
            data, label, relpath = reader.read(i)
            assert data == (src / relpath).read_bytes()
            f.seek(int(extents[i]["offset"]))
            assert f.read(int(extents[i]["length"])).endswith(data)
    reader.close()
    # Extents that point at the wrong record (a database rewritten by another tool) are
    # caught by the header check: a warning, and the records still come back right.
    put_table(out, "extents", extents[[1, 0, 2, 3, 4, 5]].tobytes())
    reader = lmdb_format.Reader(str(out))
    with pytest.warns(RuntimeWarning, match="extents do not match"):
        data, _, relpath = reader.read(0)
    assert data == (src / relpath).read_bytes() and relpath == reader.paths[0]
    assert reader.extents() is None
    assert [reader.read(i)[2] for i in range(6)] == [reader.paths[i] for i in range(6)]
    reader.close()


@pytest.mark.skipif(not HAS_EXTENTS, reason="extents are taken from the writemap mapping (Linux)")
@pytest.mark.parametrize("check_crc", [True, False])
def test_image_bytes_are_placed_past_paths_of_any_length_in_shuffled_storage(tmp_path, check_crc):
    # Reads go straight to each image's bytes, past a header and path whose length differs
    # per record; a shuffled pack stores records out of index order, so the lengths must
    # follow storage order, not index order.
    src = tmp_path / "src"
    names = ["a.jpg", "a_much_longer_file_name_than_the_others.jpg", "deep/er/still/x.jpg", "ü名.jpg"]
    for i in range(12):
        write(src / f"c{i % 3}" / f"{i:02d}{names[i % 4]}", jpeg_bytes(i, size=(160, 120)))
    out = tmp_path / "shuffled.lmdb"
    pack(str(src), "lmdb", str(out), progress=False, shuffle=True, shuffle_seed=3)
    reader = lmdb_format.Reader(str(out), check_crc=check_crc)
    assert reader.storage_order() is not None and reader.extents() is not None
    expected = [(src / reader.paths[i]).read_bytes() for i in range(12)]
    assert [reader.read_image(i)[0] for i in range(12)] == expected
    with open(out / "data.mdb", "rb") as f:
        for i, (_, offset, length) in enumerate(reader.record_extents(np.arange(12))):
            f.seek(offset)
            assert f.read(length) == expected[i]
    assert reader.extents() is not None  # no read fell back to the map
    reader.close()


def pack_with_extents_rewritten(tmp_path, count: int, rewrite) -> tuple:
    """A pack of count page-sized records whose stored extents are then rewritten by rewrite."""
    src = tmp_path / "src"
    for i in range(count):
        write(src / f"c{i % 2}" / f"{i:02d}.jpg", jpeg_bytes(i, size=(160, 120)))
    out = tmp_path / "big.lmdb"
    pack(str(src), "lmdb", str(out), progress=False)
    reader = lmdb_format.Reader(str(out))
    extents = reader.extents().copy()
    reader.close()
    put_table(out, "extents", rewrite(extents).tobytes())
    return src, out


def put_table(out, table: str, raw: bytes, split: str = "all") -> None:
    """Rewrite one table of a packed LMDB, with its checksum: what another tool that moves
    records (mdb_copy -c) leaves is consistent tables over moved values."""
    env = lmdb.open(str(out), map_size=os.path.getsize(out / "data.mdb") + (1 << 20), lock=False)
    with env.begin(write=True) as txn:
        txn.put(f"{split}/{table}".encode(), raw)
        checksums = json.loads(txn.get(f"{split}/checksums".encode()))
        checksums[table] = zlib.crc32(raw)
        txn.put(f"{split}/checksums".encode(), json.dumps(checksums).encode())
    env.close()


@pytest.mark.skipif(not HAS_EXTENTS, reason="extents are taken from the writemap mapping (Linux)")
@pytest.mark.parametrize("check_crc", [True, False])
def test_moved_records_are_caught_when_extents_load(tmp_path, check_crc):
    # Every value moved (as when another tool rewrites the database): the spot check made
    # when the extents load catches it, even with check_crc off, where reads skip headers.
    src, out = pack_with_extents_rewritten(tmp_path, 20, lambda e: np.roll(e, 1))
    reader = lmdb_format.Reader(str(out), check_crc=check_crc)
    with pytest.warns(RuntimeWarning, match="extents do not match"):
        assert reader.extents() is None
    assert [reader.read(i)[0] for i in range(20)] == [(src / p).read_bytes() for p in reader.paths]
    reader.close()


@pytest.mark.skipif(not HAS_EXTENTS, reason="extents are taken from the writemap mapping (Linux)")
def test_with_check_crc_each_read_checks_its_header(tmp_path):
    # Two records the spot check does not sample trade places: with check_crc on, the
    # header read with each record catches it.
    def swap(extents):
        extents[[3, 4]] = extents[[4, 3]]
        return extents

    src, out = pack_with_extents_rewritten(tmp_path, 20, swap)
    reader = lmdb_format.Reader(str(out))
    assert reader.extents() is not None
    with pytest.warns(RuntimeWarning, match="extents do not match"):
        data, _, relpath = reader.read(3)
    assert data == (src / relpath).read_bytes() and relpath == reader.paths[3]
    assert reader.extents() is None
    reader.close()


def test_map_grows_past_its_initial_size(image_tree, tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_format, "INITIAL_MAP_SIZE", 64 << 10)
    monkeypatch.setattr(lmdb_format, "TXN_BYTES", 16 << 10)
    out = tmp_path / "grown.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False, workers=1)
    ds = readers.LMDBDataset(out, decode="raw")
    assert sum(len(ds[i][0]) for i in range(len(ds))) > 64 << 10
    assert [ds[i][0] for i in range(len(ds))] == [(image_tree / p).read_bytes() for p in ds.paths]


def test_a_record_larger_than_the_map_and_a_transaction_fits(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_format, "INITIAL_MAP_SIZE", 64 << 10)
    monkeypatch.setattr(lmdb_format, "TXN_BYTES", 16 << 10)
    src = tmp_path / "src"
    files = {"a/small.jpg": jpeg_bytes(1), "a/huge.png": jpeg_bytes(2, size=(400, 300), fmt="PNG"),
             "b/after.jpg": jpeg_bytes(3)}
    for relpath, data in files.items():
        write(src / relpath, data)
    assert len(files["a/huge.png"]) > 4 * (64 << 10)
    out = tmp_path / "big.lmdb"
    pack(str(src), "lmdb", str(out), progress=False, workers=1)
    ds = readers.LMDBDataset(out, decode="raw")
    assert {ds.paths[i]: ds[i][0] for i in range(len(ds))} == files


def test_a_full_map_mid_transaction_fails_cleanly(image_tree, tmp_path, monkeypatch):
    # The map is grown ahead of every transaction, so this needs a broken size estimate.
    from packer import PackError

    monkeypatch.setattr(lmdb_format, "INITIAL_MAP_SIZE", 64 << 10)
    monkeypatch.setattr(lmdb_format, "room", lambda txn_bytes: 0)
    out = tmp_path / "full.lmdb"
    with pytest.raises(PackError, match="LMDB map full although it was grown"):
        pack(str(image_tree), "lmdb", str(out), progress=False, workers=1)
    assert not out.exists() and not list(tmp_path.glob("full.lmdb.partial-*"))


def test_forked_child_reopens_instead_of_using_the_inherited_environment(image_tree, tmp_path):
    out = tmp_path / "f.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False)
    ds = readers.LMDBDataset(out, decode="raw")
    expected = [ds[i][0] for i in range(len(ds))]  # the parent's environment is open now
    other = readers.LMDBDataset(out, decode="raw")  # a second dataset on the same path shares it
    assert other[1][0] == expected[1]
    inherited = ds.reader.handle()[0]
    pid = os.fork()
    if pid == 0:  # child: exit code 0 only if it reads through a fresh environment of its own
        ok = [ds[i][0] for i in range(len(ds))] == expected and other[2][0] == expected[2]
        ok = ok and ds.reader.handle()[0] is not inherited and ds.reader.handle()[0] is other.reader.handle()[0]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ds[0][0] == expected[0]  # the parent's handle still works after the child exited


def test_readers_share_one_environment_per_process(image_tree, tmp_path):
    out = tmp_path / "r.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False)
    a, b = readers.LMDBDataset(out, decode="raw"), readers.LMDBDataset(out, decode="raw")
    a[0], b[0]
    assert a.reader.handle()[0] is b.reader.handle()[0]
    a.close()
    assert b[1][0]  # still open for b


def test_data_file_is_cut_back_to_the_pages_in_use(image_tree, tmp_path):
    out = tmp_path / "small.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False)
    size = (out / "data.mdb").stat().st_size
    env = lmdb.open(str(out), readonly=True, lock=False)
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    env.close()
    assert size == used < lmdb_format.INITIAL_MAP_SIZE


def test_no_space_for_the_next_transaction_is_a_clean_error(image_tree, tmp_path, monkeypatch):
    import errno

    from packer import PackError

    if not lmdb_format.WRITEMAP:
        pytest.skip("space is reserved only where LMDB writes through its memory map")

    def disk_full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", disk_full)
    out = tmp_path / "full.lmdb"
    with pytest.raises(PackError, match="writing the lmdb dataset failed .*No space left on device"):
        pack(str(image_tree), "lmdb", str(out), progress=False)
    assert not out.exists() and not list(tmp_path.glob("full.lmdb.partial-*"))


def test_a_damaged_page_on_the_way_to_a_record_is_a_corrupt_data_error(tmp_path):
    # Garbage over the middle of data.mdb hits B-tree pages as well as record bytes: LMDB's
    # own error (MDB_CORRUPTED, MDB_PAGE_NOTFOUND) is named as damage, not raised as it is.
    src = class_sorted_tree(tmp_path / "src", 8, 20)
    out = tmp_path / "d.lmdb"
    pack(str(src), "lmdb", str(out))
    data = out / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.seek(size // 4 // 4096 * 4096)
        f.write(random.Random(0).randbytes(size // 4))
    reader = lmdb_format.Reader(str(out), check_crc=False)
    failures = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the extents' spot check says so too
        for i in range(len(reader)):
            try:
                reader.read_image(i)
            except CorruptDataError as exc:
                failures.append(str(exc))
    reader.close()
    assert failures and all("damaged" in message for message in failures)
