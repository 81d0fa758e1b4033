"""Metadata and path tables read from hostile or damaged datasets: checked once on load,
refused with the project's errors, never followed outside the dataset."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

from packer import FORMATS
from packer.cli import main
from packer.convert import convert
from packer.errors import CorruptDataError, FormatError, PackError
from packer.formats import open_reader, read_metadata
from packer.verify import info, verify

from test_fuzz_metadata import (CONTAINER_KEYS, build_source, documented_crc, pack_all, read_raw, restamp_table_crc,
                                rewrite_metadata, write_raw)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(SRC, {format: packed dataset}), packed once for the module; tests edit copies."""
    root = tmp_path_factory.mktemp("pristine")
    src = build_source(root / "src")
    return src, pack_all(src, root)


@pytest.fixture
def copy_of(pristine, tmp_path):
    def copy(fmt: str, folder: Path | None = None) -> Path:
        target = (folder or tmp_path / "ds") / f"data{FORMATS[fmt].extension}"
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if pristine[1][fmt].is_dir() else shutil.copyfile)(pristine[1][fmt], target)
        return target
    return copy


@pytest.fixture(params=list(FORMATS))
def fmt(request):
    return request.param


def files_under(root: Path) -> set[Path]:
    return {Path(d, f) for d, dirs, files in os.walk(root) for f in dirs + files}


def refused_by_cli(args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert fragment in result.stderr, result.stderr


# ---- case 5: split names that leave OUT --------------------------------------------------------

def rename_lmdb_split(path: Path, old: str, new: str) -> None:
    env = lmdb.open(str(path), subdir=True, lock=False, map_size=os.path.getsize(path / "data.mdb") + (64 << 20))
    with env.begin(write=True) as txn:
        prefix = old.encode() + b"/"
        moved = [(k, v) for k, v in txn.cursor() if k.startswith(prefix)]
        for key, value in moved:
            txn.delete(key)
            txn.put(new.encode() + key[len(old):], value)
    env.close()


def rename_split_in_metadata(obj: dict, old: str, new: str) -> None:
    obj["splits"][new] = obj["splits"].pop(old)
    if "wds" in obj:
        obj["wds"]["splits"][new] = obj["wds"]["splits"].pop(old)


@pytest.mark.parametrize("source_fmt", ["lmdb", "wds"])
def test_convert_refuses_a_split_named_to_climb_out_of_out(source_fmt, copy_of, tmp_path):
    packed = copy_of(source_fmt)
    if source_fmt == "lmdb":
        rename_lmdb_split(packed, "train", "../../escape")
    rewrite_metadata(source_fmt, packed, lambda obj: rename_split_in_metadata(obj, "train", "../../escape"))
    out = tmp_path / "a" / "b" / "out.wds"
    out.parent.mkdir(parents=True)
    before = files_under(tmp_path)
    with pytest.raises(FormatError, match=r"split name '\.\./\.\./escape' starts with"):
        convert(str(packed), "wds", str(out), workers=1, progress=False)
    assert files_under(tmp_path) == before  # nothing escaped (it would land in a/escape), no OUT
    refused_by_cli(["verify", str(packed)], "split name '../../escape'")


def test_convert_refuses_an_absolute_hdf5_group_as_split(copy_of, tmp_path):
    packed = copy_of("hdf5")
    escape = str(tmp_path / "escape")  # an absolute HDF5 group path is also an absolute file path
    with h5py.File(packed, "r+") as f:
        f.require_group(os.path.dirname(escape))
        f.move("/train", escape)
    rewrite_metadata("hdf5", packed, lambda obj: rename_split_in_metadata(obj, "train", escape))
    out = tmp_path / "out.wds"
    with pytest.raises(FormatError, match="holds a \"/\""):
        convert(str(packed), "wds", str(out), workers=1, progress=False)
    assert not os.path.exists(escape) and not out.exists()


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "/x", "a/b", "a\\b", ".hidden", "a\0b", "x\ny",
                                  "\udcff", "x" * 256])
def test_writers_refuse_split_names_that_are_not_one_folder_name(name, fmt, tmp_path):
    writer = FORMATS[fmt].Writer(str(tmp_path / f"stage{FORMATS[fmt].extension}"), FORMATS[fmt].writer_options({}))
    if FORMATS[fmt].directory:
        os.makedirs(tmp_path / f"stage{FORMATS[fmt].extension}", exist_ok=True)
    try:
        with pytest.raises(FormatError, match="split name"):
            writer.begin_split(name)
    finally:
        writer.abort()
    assert not (tmp_path / "x").exists()


# ---- case 6: the WDS index names files outside the dataset -----------------------------------

def edit_wds_section(packed: Path, edit) -> None:
    rewrite_metadata("wds", packed, lambda obj: edit(obj["wds"]["splits"]["train"]))


def refused_everywhere(packed: Path, out: Path, fragment: str) -> None:
    """open, verify, info and convert all refuse the dataset, naming what is wrong."""
    with pytest.raises(FormatError, match=fragment):
        open_reader(packed, "train")
    with pytest.raises(FormatError, match=fragment):
        verify(str(packed), workers=1)
    with pytest.raises(FormatError, match=fragment):
        info(str(packed))
    with pytest.raises(FormatError, match=fragment):
        convert(str(packed), "lmdb", str(out), workers=1, progress=False)
    assert not out.exists()


@pytest.mark.parametrize("name", ["../outside.tar", "train/../../outside.tar", "ABSOLUTE"])
def test_wds_shard_named_outside_the_dataset_is_refused(name, copy_of, tmp_path):
    packed = copy_of("wds")
    outside = packed.parent / "outside.tar"  # a readable shard, so only the name check stops it
    shutil.copyfile(packed / "train" / "shard-000000.tar", outside)
    name = str(outside) if name == "ABSOLUTE" else name
    edit_wds_section(packed, lambda entry: entry["shards"][0].update(name=name))
    refused_everywhere(packed, tmp_path / "out.lmdb", "is not train/<name>.tar")


def test_wds_shard_symlinked_outside_the_dataset_is_refused(copy_of, tmp_path):
    packed = copy_of("wds")
    shard = packed / "train" / "shard-000000.tar"
    elsewhere = tmp_path / "elsewhere.tar"
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)
    refused_everywhere(packed, tmp_path / "out.lmdb", "leads outside the dataset folder")


@pytest.mark.parametrize("table", ["records", "paths"])
def test_wds_tables_named_outside_the_dataset_are_refused(table, copy_of, tmp_path):
    packed = copy_of("wds")
    secret = tmp_path / "secret.txt"
    real = packed / "train" / f"{table}.bin"
    # A well-formed table of the right length, so nothing but the name can refuse it.
    secret.write_bytes(b"\0".join(b"SECRET-%d.jpg" % i for i in range(7)) if table == "paths"
                       else real.read_bytes())
    edit_wds_section(packed, lambda entry: entry.update({table: str(secret)}))
    refused_everywhere(packed, tmp_path / "out.lmdb", "not train/records.bin and train/paths.bin")
    assert not any(b"SECRET" in p.read_bytes() for p in files_under(tmp_path) if p.is_file() and p != secret)


# ---- case 6: unsafe paths in the path table ------------------------------------------------

def rewrite_paths(fmt: str, packed: Path, split: str, paths: list[str]) -> None:
    blob = "\0".join(paths).encode()
    if fmt == "lmdb":
        env = lmdb.open(str(packed), subdir=True, lock=False, map_size=os.path.getsize(packed / "data.mdb") + (64 << 20))
        with env.begin(write=True) as txn:
            txn.put(f"{split}/paths".encode(), blob)
        env.close()
    elif fmt == "hdf5":
        with h5py.File(packed, "r+") as f:
            del f[f"{split}/paths"]
            f[f"{split}/paths"] = np.frombuffer(blob, np.uint8)
    else:
        (packed / split / "paths.bin").write_bytes(blob)
    restamp_table_crc(fmt, packed, split, "paths", blob)


def test_path_table_climbing_out_is_refused_by_readers_verify_and_convert(fmt, copy_of, pristine, tmp_path):
    src = pristine[0]
    packed = copy_of(fmt)
    reader = open_reader(packed, "train")
    paths = list(reader.paths)
    reader.close()
    # The file the crafted path leads to exists, so only the table check stops verify reading it.
    (src.parent / "outside.jpg").write_bytes((src / paths[0]).read_bytes())
    paths[0] = "../outside.jpg"
    rewrite_paths(fmt, packed, "train", paths)
    with pytest.raises(CorruptDataError, match=r"train/paths.*: path 0 \('\.\./outside\.jpg'\) is not a safe"):
        open_reader(packed, "train").paths
    report = verify(str(packed), str(src), workers=1)
    assert any("is not a safe relative path" in p for p in report.problems), report.problems
    out = tmp_path / "out.wds"  # tar members would be named ../outside_jpg.jpg
    with pytest.raises(CorruptDataError, match="not a safe relative path"):
        convert(str(packed), "wds", str(out), workers=1, progress=False)
    assert not out.exists()


# ---- case 12: hand-edited metadata ----------------------------------------------------------

def test_deeply_nested_metadata_is_a_format_error(fmt, copy_of):
    packed = copy_of(fmt)
    write_raw(fmt, str(packed), b"[" * 200_000)
    with pytest.raises(FormatError, match="nested too deeply"):
        open_reader(packed)
    refused_by_cli(["info", str(packed)], "not valid JSON (nested too deeply)")
    refused_by_cli(["verify", str(packed)], "not valid JSON (nested too deeply)")


def test_format_version_too_large_for_a_float_is_a_format_error(fmt, copy_of):
    packed = copy_of(fmt)
    rewrite_metadata(fmt, packed, lambda obj: obj.pop("crc32", None))  # else the checksum speaks first
    raw = read_raw(fmt, str(packed))
    write_raw(fmt, str(packed), raw.replace(b'"format_version": 1', b'"format_version": 1e400'))
    with pytest.raises(FormatError, match="format_version is inf"):
        read_metadata(packed)


def test_newer_format_version_asks_for_an_upgrade_unless_the_checksum_says_damage(copy_of):
    packed = copy_of("lmdb")
    rewrite_metadata("lmdb", packed, lambda obj: obj.update(format_version=3))
    with pytest.raises(FormatError, match=r"format version 3, this packer reads up to 2 \(upgrade packer to read it\)$"):
        read_metadata(packed)
    raw = read_raw("lmdb", str(packed)).replace(b'"format_version": 3', b'"format_version": 7')  # one bit
    write_raw("lmdb", str(packed), raw)
    with pytest.raises(FormatError, match=r"\(upgrade packer to read it\), or damaged \(checksum mismatch"):
        read_metadata(packed)


def test_negative_split_count_fails_verify(fmt, copy_of):
    packed = copy_of(fmt)
    rewrite_metadata(fmt, packed, lambda obj: obj["splits"]["val"].update(count=-5))
    result = CliRunner().invoke(main, ["verify", str(packed)])
    assert result.exit_code == 1 and "records intact" not in result.stderr
    assert "split 'val' count is -5, not a whole number" in result.stderr


def set_path(obj, path, value):
    for step in path[:-1]:
        obj = obj[step]
    obj[path[-1]] = value


def delete_path(obj, path):
    for step in path[:-1]:
        obj = obj[step]
    del obj[path[-1]]


EDITS = {  # a hand edit -> what the error says
    "classes not a list": (lambda o: set_path(o, ["classes"], "class a"), "classes is 'class a', not a list"),
    "class with NUL": (lambda o: set_path(o, ["classes", 0], "a\0b"), "is not a folder name"),
    "class twice": (lambda o: set_path(o, ["classes", 1], "class a"), "holds a name twice"),
    "one class fewer": (lambda o: o["classes"].pop(), "does not give one count per class"),
    "count as text": (lambda o: set_path(o, ["splits", "train", "count"], "7"), "count is '7', not a whole number"),
    "count true": (lambda o: set_path(o, ["splits", "train", "count"], True), "count is True"),
    "bytes float": (lambda o: set_path(o, ["splits", "train", "bytes"], 1.5), "bytes is 1.5"),
    "huge count": (lambda o: set_path(o, ["splits", "train", "count"], 10**30), "not a whole number from 0"),
    "class counts off": (lambda o: set_path(o, ["splits", "train", "class_counts"], [1, 1, 1]), "summing to"),
    "splits empty": (lambda o: set_path(o, ["splits"], {}), "naming at least one split"),
    "no splits": (lambda o: delete_path(o, ["splits"]), "splits is None"),
    "unknown format": (lambda o: set_path(o, ["format"], "zip"), "format is 'zip', not one of lmdb, hdf5, wds"),
    "version zero": (lambda o: set_path(o, ["format_version"], 0), "format_version is 0"),
    "skipped entry": (lambda o: set_path(o, ["skipped", 0], {"path": 3}), "skipped entry"),
    "params list": (lambda o: set_path(o, ["params"], []), "params is [], not an object"),
    "converted_from text": (lambda o: set_path(o, ["params", "converted_from"], "x"), "params.converted_from"),
    "labeled text": (lambda o: set_path(o, ["splits", "test", "labeled"], "no"), "labeled is 'no'"),
    "total count": (lambda o: set_path(o, ["count"], 1), "count is 1, but the splits add up to"),
    "deep params": (lambda o: set_path(o, ["params", "x"], json.loads("[" * 150 + "]" * 150)), "nested over"),
    "empty object": (lambda o: o.clear(), "format_version is None"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_hand_edited_metadata_is_a_format_error(edit, fmt, copy_of):
    packed = copy_of(fmt)
    change, message = EDITS[edit]
    rewrite_metadata(fmt, packed, change)
    with pytest.raises(FormatError, match=re.escape(message)):
        read_metadata(packed)
    refused_by_cli(["info", str(packed)], "bad packer metadata")


def test_a_reader_built_directly_refuses_metadata_naming_no_format_as_read_metadata_does(fmt, copy_of):
    packed = copy_of(fmt)
    rewrite_metadata(fmt, packed, lambda o: set_path(o, ["format"], "zip"))
    with pytest.raises(FormatError, match="format is 'zip', not one of lmdb, hdf5, wds") as direct:
        FORMATS[fmt].Reader(str(packed))
    with pytest.raises(FormatError) as through_registry:
        read_metadata(packed)
    assert str(direct.value) == str(through_registry.value)


def test_oversized_metadata_is_refused_before_parsing(copy_of):
    packed = copy_of("wds")
    (packed / "index.json").write_bytes(b" " * (64 << 20) + b"{}")
    with pytest.raises(FormatError, match="over the 67108864 packer reads"):
        read_metadata(packed)


def test_metadata_that_is_not_text_is_a_format_error(copy_of):
    packed = copy_of("hdf5")
    write_raw("hdf5", str(packed), b"", kind="number")
    with pytest.raises(FormatError, match="not JSON text"):
        read_metadata(packed)


# ---- the metadata checksum -------------------------------------------------------------------

def test_metadata_checksum_follows_the_documented_recipe(fmt, pristine):
    obj = json.loads(read_raw(fmt, str(pristine[1][fmt])).decode("utf-8", "surrogateescape"))
    assert obj["crc32"] == documented_crc(obj, CONTAINER_KEYS[fmt])


def test_a_damaged_class_name_fails_the_metadata_checksum(fmt, copy_of):
    packed = copy_of(fmt)
    raw = read_raw(fmt, str(packed))
    assert raw.count(b'"class b"') == 1
    write_raw(fmt, str(packed), raw.replace(b'"class b"', b'"class c"'))  # one bit, still valid JSON
    with pytest.raises(FormatError, match="checksum mismatch"):
        open_reader(packed, "train")
    refused_by_cli(["verify", str(packed)], "checksum mismatch")


def test_metadata_without_a_checksum_is_read_as_an_older_pack(fmt, copy_of):
    packed = copy_of(fmt)
    rewrite_metadata(fmt, packed, lambda obj: obj.pop("crc32"))
    assert verify(str(packed), workers=1).ok


def test_a_damaged_checksum_key_is_not_taken_for_an_older_pack(fmt, copy_of):
    packed = copy_of(fmt)
    raw = read_raw(fmt, str(packed))
    write_raw(fmt, str(packed), raw.replace(b'"crc32"', b'"crc33"'))
    with pytest.raises(FormatError, match=r"unknown key\(s\) \['crc33'\] and no crc32"):
        read_metadata(packed)


def test_damage_to_the_wds_shard_list_is_left_to_its_own_checks(copy_of):
    """The checksum leaves out "wds": verify still reports a damaged shard entry, per shard."""
    packed = copy_of("wds")
    edit_wds_section(packed, lambda entry: entry["shards"][0].update(count=99))
    report = verify(str(packed), workers=1)
    assert [p for p in report.problems if "the index says 99" in p]


def test_writing_metadata_that_could_not_be_read_back_is_refused():
    from packer.records import Metadata, SplitInfo
    meta = Metadata("lmdb", ["a", "b"], {"train": SplitInfo(3, 10, [1, 1])})
    with pytest.raises(FormatError, match="cannot write this dataset's metadata: split 'train' class_counts"):
        meta.to_json()


# ---- the path table --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["/etc/passwd", "../x.jpg", "a/../../x.jpg", "a/./b.jpg", "./a.jpg", "a//b.jpg",
                                 "a/b/", "", ".", "..", "a/.."])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_path_table_refuses_paths_that_are_not_safe_relative_paths(bad, position):
    from packer.records import PathTable
    paths = ["cat/a.jpg", "dog/b.jpg", "dog/c.jpg"]
    paths[position] = bad
    raw = "\0".join(paths).encode()
    with pytest.raises(CorruptDataError, match=rf"^where: path {position} \(.*\) is not a safe relative path"):
        PathTable.from_nul_separated(raw, "where")


def test_path_table_keeps_unusual_but_safe_names():
    from packer.records import PathTable
    names = ["a\\b.jpg", "...", "a/...b/.c.jpg", "..x/y..", "名前/x y.jpg", "v1.2/img.v2.final.jpg",
             b"caf\xe9/\xff.jpg".decode("utf-8", "surrogateescape")]
    table = PathTable.from_strings(names)
    assert list(table) == names
    assert len(PathTable.from_nul_separated(b"")) == 0
