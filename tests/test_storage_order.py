"""Shuffled packs of the map-style formats: records stored in a seeded permutation, read by index."""
from __future__ import annotations

import json

import h5py
import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

from packer import pack
from packer.cli import main
from packer.errors import CorruptDataError
from packer.formats import _tables
from packer.formats import open_reader
from packer.formats.wds import stored_part
from packer.pack import write_order
from packer.verify import verify

from conftest import class_sorted_tree


@pytest.fixture
def sorted_tree(tmp_path):
    return class_sorted_tree(tmp_path / "src", classes=3, per_class=7)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_shuffled_pack_keeps_index_order_and_stores_the_permutation(sorted_tree, tmp_path, fmt):
    out = tmp_path / f"s.{fmt}"
    plain = tmp_path / f"p.{fmt}"
    pack(str(sorted_tree), fmt, str(out), shuffle=True, shuffle_seed=7, progress=False, workers=1)
    pack(str(sorted_tree), fmt, str(plain), shuffle=False, progress=False, workers=1)
    shuffled, ordered = open_reader(str(out)), open_reader(str(plain))
    # By index, a shuffled pack reads exactly like an ImageFolder-order one.
    assert list(shuffled.paths) == list(ordered.paths)
    np.testing.assert_array_equal(shuffled.labels, ordered.labels)
    for i in range(len(shuffled)):
        data, label, relpath = shuffled.read(i)
        assert data == (sorted_tree / relpath).read_bytes() and label == ordered.labels[i]
    # Stored in the seeded permutation pack() documents.
    order = shuffled.storage_order()
    np.testing.assert_array_equal(order, write_order(21, "all", 7))
    assert ordered.storage_order() is None or np.array_equal(ordered.storage_order(), np.arange(21))
    assert verify(str(out), against=str(sorted_tree)).ok
    shuffled.close()
    ordered.close()


def test_shuffled_lmdb_stores_records_by_position_for_other_tools(sorted_tree, tmp_path):
    out = tmp_path / "s.lmdb"
    pack(str(sorted_tree), "lmdb", str(out), shuffle=True, shuffle_seed=3, progress=False, workers=1)
    env = lmdb.open(str(out), readonly=True, lock=False)
    with env.begin() as txn:
        order = np.frombuffer(txn.get(b"all/order"), "<i4")
        paths = txn.get(b"all/paths").decode().split("\0")
        for position, index in enumerate(order):
            value = txn.get(b"all/%010d" % position)
            n = int.from_bytes(value[8:10], "little")
            assert value[10:10 + n].decode() == paths[index]
    env.close()


def test_shuffled_hdf5_describes_the_blob_by_position(sorted_tree, tmp_path):
    out = tmp_path / "s.h5"
    pack(str(sorted_tree), "hdf5", str(out), shuffle=True, shuffle_seed=3, progress=False, workers=1)
    with h5py.File(out, "r") as f:
        g = f["all"]
        order, offsets, images = g["order"][()], g["offsets"][()], g["images"]
        paths = g["paths"][()].tobytes().decode().split("\0")
        for position, index in enumerate(order):
            data = images[offsets[position]:offsets[position + 1]].tobytes()
            assert data == (sorted_tree / paths[index]).read_bytes()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_cli_shuffle_seed_turns_shuffling_on_for_map_formats(sorted_tree, tmp_path, fmt):
    out = tmp_path / f"c.{fmt}"
    result = CliRunner().invoke(main, ["pack", str(sorted_tree), "--to", fmt, "-o", str(out), "--shuffle-seed", "5",
                                       "--workers", "1"])
    assert result.exit_code == 0, result.output
    facts = json.loads(CliRunner().invoke(main, ["info", str(out), "--json"]).stdout)
    assert facts["params"]["shuffle_seed"] == 5
    reader = open_reader(str(out))
    np.testing.assert_array_equal(reader.storage_order(), write_order(21, "all", 5))
    reader.close()
    default = tmp_path / f"d.{fmt}"
    assert CliRunner().invoke(main, ["pack", str(sorted_tree), "--to", fmt, "-o", str(default)]).exit_code == 0
    reader = open_reader(str(default))
    assert reader.storage_order() is None
    reader.close()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_shuffled_pack_that_skips_bad_files_still_reads_by_index(bad_tree, tmp_path, fmt):
    out = tmp_path / f"k.{fmt}"
    result = pack(str(bad_tree), fmt, str(out), on_error="skip", shuffle=True, shuffle_seed=1, progress=False,
                  workers=1)
    reader = open_reader(str(out))
    assert len(reader) == result.metadata.splits["all"].count == 3
    assert list(reader.paths) == sorted(reader.paths)  # index order is ImageFolder order among kept files
    for i in range(len(reader)):
        data, label, relpath = reader.read(i)
        assert relpath == reader.paths[i] and data == (bad_tree / relpath).read_bytes()
    assert sorted(reader.storage_order().tolist()) == [0, 1, 2]
    reader.close()


def test_convert_can_shuffle_into_a_map_format(sorted_tree, tmp_path):
    plain = tmp_path / "p.lmdb"
    pack(str(sorted_tree), "lmdb", str(plain), progress=False, workers=1)
    out = tmp_path / "c.h5"
    result = CliRunner().invoke(main, ["convert", str(plain), "--to", "hdf5", "-o", str(out), "--shuffle-seed", "4",
                                       "--workers", "1"])
    assert result.exit_code == 0, result.output
    reader = open_reader(str(out))
    np.testing.assert_array_equal(reader.storage_order(), write_order(21, "all", 4))
    for i in range(len(reader)):
        data, _, relpath = reader.read(i)
        assert relpath == reader.paths[i] and data == (sorted_tree / relpath).read_bytes()
    reader.close()


def test_shuffled_wds_stores_its_order_and_reads_each_shard_from_it(sorted_tree, tmp_path):
    out = tmp_path / "s.wds"
    pack(str(sorted_tree), "wds", str(out), shuffle=True, shuffle_seed=5, progress=False, workers=1,
         options={"max_count": 8})
    entry = json.loads((out / "index.json").read_text())["wds"]["splits"]["all"]
    stored = np.fromfile(out / "all" / "order.bin", "<i4")
    np.testing.assert_array_equal(stored, write_order(21, "all", 5))
    reader = open_reader(str(out))
    assert reader.order_table == entry["order"] == "all/order.bin"
    runs = [reader.stored_in(shard).tolist() for shard in range(len(reader.shards))]
    assert sum(runs, []) == stored.tolist()
    assert all(reader.records["shard"][run].tolist() == [shard] * len(run) for shard, run in enumerate(runs))
    reader.close()
    # A pack written before the table (no "order") sorts records.bin into the same order.
    index = json.loads((out / "index.json").read_text())
    del index["wds"]["splits"]["all"]["order"], index["wds"]["splits"]["all"]["order_crc32"]
    (out / "index.json").write_text(json.dumps(index))
    (out / "all" / "order.bin").unlink()
    older = open_reader(str(out))
    assert older.order_table is None
    np.testing.assert_array_equal(older.storage_order(), stored)
    assert [older.stored_in(shard).tolist() for shard in range(len(older.shards))] == runs
    older.close()


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_part_of_a_wds_shard_run_is_that_slice_of_the_run(sorted_tree, tmp_path, shuffle):
    # A resumed stream reads one-sample parts of a shard's run: each is the whole run's
    # slice, asked for before the run was checked (the whole run is checked) or after.
    out = tmp_path / "s.wds"
    pack(str(sorted_tree), "wds", str(out), shuffle=shuffle, shuffle_seed=5, progress=False, workers=1,
         options={"max_count": 8})
    whole = open_reader(str(out))
    runs = [whole.stored_in(shard).tolist() for shard in range(len(whole.shards))]
    for shard, run in enumerate(runs):
        for start, stop in [(0, None), (3, 4), (len(run) - 1, None), (2, 0), (5, 99), (len(run), None)]:
            first = open_reader(str(out))  # the part asked for first: the run not yet checked
            assert stored_part(first, shard, start, stop).tolist() == run[start:stop]
            assert stored_part(whole, shard, start, stop).tolist() == run[start:stop]
            first.close()
    whole.close()


@pytest.mark.parametrize("large", [False, True])
def test_a_damaged_wds_order_fails_the_shard_that_uses_it_and_verify(sorted_tree, tmp_path, large, monkeypatch):
    # Up to CRC_AT_OPEN the table is CRC-checked when mapped; a larger one (a limit of 0 stands
    # in for it) is checked a shard's run at a time as streams use it, and whole by verify.
    if large:
        monkeypatch.setattr(_tables, "CRC_AT_OPEN", 0)
    out = tmp_path / "s.wds"
    pack(str(sorted_tree), "wds", str(out), shuffle=True, shuffle_seed=5, progress=False, workers=1,
         options={"max_count": 8})
    order = np.fromfile(out / "all" / "order.bin", "<i4")
    order[[0, -1]] = order[[-1, 0]]  # two samples of different shards trade places
    order.tofile(out / "all" / "order.bin")
    reader = open_reader(str(out))
    message = r"order\.bin: shard 0's 8 samples are not the ones records\.bin" if large else r"order\.bin: checksum"
    with pytest.raises(CorruptDataError, match=message):
        reader.stored_in(0)
    assert any("order.bin: checksum mismatch" in problem for problem in verify(str(out)).problems)
