"""packer.replaceable on real files: --force replaces a dataset packer wrote, and refuses
every look-alike by name, with what was found, whichever command writes (pack, convert, merge)."""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from packer import FORMATS, pack
from packer.cli import main
from packer.formats import _wds_index, wds
from packer.records import metadata_crc

from conftest import snapshot, tree, write


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def count(path: Path) -> int:
    result = run("info", path, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["count"]


def packed(tmp_path: Path, fmt: str, name: str = "old") -> Path:
    out = tmp_path / f"{name}{FORMATS[fmt].extension}"
    pack(str(tree(tmp_path / f"src-{name}", 3, seed=50)), fmt, str(out), workers=1, progress=False)
    return out


def user_model(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:  # what h5py or Keras saves: weights in groups, attributes
        f.create_dataset("dense/kernel", data=np.ones((4, 4), np.float32))
        f.attrs["backend"] = "tensorflow"
    return path


def wds_index(folder: Path, raw: bytes) -> Path:
    write(folder / "index.json", raw)
    write(folder / "train" / "shard-000000.tar", b"shards of another tool")
    return folder


# Each look-alike: how it is made under tmp_path, and what the refusal says was found.
LOOK_ALIKES = {
    "folder with data.mdb and a user's file": (
        lambda t: (write(t / "proj" / "data.mdb", b""), write(t / "proj" / "thesis.tex", b"x"))[0].parent,
        "holds a data.mdb without valid packer metadata"),
    "a user's HDF5 model": (lambda t: user_model(t / "model.h5"), "holds an HDF5 file without valid packer metadata"),
    "index.json that does not parse": (lambda t: wds_index(t / "w", b"{not json"), "an index.json without valid"),
    "index.json {}": (lambda t: wds_index(t / "w", b"{}"), "an index.json without valid packer metadata"),
    "index.json []": (lambda t: wds_index(t / "w", b"[]"), "an index.json without valid packer metadata"),
    "index.json with a count": (lambda t: wds_index(t / "w", b'{"count": 3}'), "an index.json without valid"),
    "a plain file": (lambda t: write(t / "notes.txt", b"mine"), "is a file of 4 bytes that is not HDF5"),
    "an empty folder": (lambda t: (t / "empty").mkdir(parents=True) or t / "empty", "is a folder that is empty"),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", list(LOOK_ALIKES))
def test_pack_force_refuses_a_look_alike_and_keeps_it(tmp_path, kind, fmt):
    src = tree(tmp_path / "src", 4)
    make, found = LOOK_ALIKES[kind]
    out = make(tmp_path / "user")
    before = snapshot(tmp_path / "user")
    result = run("pack", src, "--to", fmt, "-o", out, "--force")
    assert result.exit_code == 1, result.output
    assert f"{out} exists and is not a packer dataset: it " in result.stderr and found in result.stderr
    assert "remove it yourself" in result.stderr and "Traceback" not in result.stderr
    assert snapshot(tmp_path / "user") == before


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_force_refuses_a_dataset_with_a_users_file_beside_its_own(tmp_path, fmt):
    out, src = packed(tmp_path, fmt), tree(tmp_path / "src", 4)
    if FORMATS[fmt].directory:  # beside data.mdb; in a split's folder, beside its shards
        extra = write(out / ("thesis.tex" if fmt == "lmdb" else "all/thesis.tex"), b"chapter one")
        found = f"and also {extra}, which packer did not write"
    else:
        with h5py.File(out, "a") as f:
            f.create_dataset("my_weights", data=np.zeros(3))
        found = "holding /my_weights, which packer does not write"
    before = snapshot(tmp_path)
    result = run("pack", src, "--to", fmt, "-o", out, "--force")
    assert result.exit_code == 1 and found in result.stderr, result.output
    assert snapshot(tmp_path) == before


def test_force_refuses_metadata_without_its_checksum(tmp_path):
    out = tmp_path / "old.wds"  # CRC-32 records: metadata as packers before metadata checksums wrote it
    pack(str(tree(tmp_path / "src-old", 3)), "wds", str(out), workers=1, progress=False, checksum="crc32")
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "crc32"}))
    result = run("pack", tree(tmp_path / "src", 4), "--to", "wds", "-o", out, "--force")
    assert result.exit_code == 1 and "has no checksum" in result.stderr, result.output


def test_force_refuses_metadata_of_another_kind_than_its_container(tmp_path):
    out = packed(tmp_path, "wds")
    index = json.loads((out / "index.json").read_text())
    index["format"] = "lmdb"
    index["crc32"] = metadata_crc(index, ("wds",))
    (out / "index.json").write_text(json.dumps(index))
    result = run("pack", tree(tmp_path / "src", 4), "--to", "lmdb", "-o", out, "--force")
    assert result.exit_code == 1 and "says 'lmdb', not 'wds'" in result.stderr, result.output


@pytest.mark.parametrize("old", list(FORMATS))
@pytest.mark.parametrize("new", list(FORMATS))
def test_force_replaces_a_packer_dataset_of_any_format(tmp_path, old, new):
    out = packed(tmp_path, old)
    result = run("pack", tree(tmp_path / "src", 5), "--to", new, "-o", out, "--force")
    assert result.exit_code == 0, result.output
    assert count(out) == 5


def test_force_replaces_an_lmdb_another_tool_opened_with_its_lock_file(tmp_path):
    import lmdb

    out = packed(tmp_path, "lmdb")
    lmdb.open(str(out), readonly=True, lock=True).close()  # as mdb_stat or a reader with locking leaves it
    assert (out / "lock.mdb").exists()
    assert run("pack", tree(tmp_path / "src", 5), "--to", "lmdb", "-o", out, "--force").exit_code == 0
    assert count(out) == 5


def test_convert_and_merge_refuse_a_look_alike_too(tmp_path):
    source = packed(tmp_path, "lmdb", "source")
    model = user_model(tmp_path / "model.h5")
    before = model.read_bytes()
    converted = run("convert", source, "--to", "hdf5", "-o", model, "--force")
    assert converted.exit_code == 1 and "not a packer dataset" in converted.stderr, converted.output
    src = tree(tmp_path / "parted", 6)
    parts = [tmp_path / f"p{i}.lmdb" for i in range(2)]
    for i, part in enumerate(parts):
        assert run("pack", src, "--to", "lmdb", "--part", f"{i}/2", "-o", part).exit_code == 0
    merged = run("merge", *parts, "-o", model, "--force")
    assert merged.exit_code == 1 and "not a packer dataset" in merged.stderr, merged.output
    assert model.read_bytes() == before


def test_wds_named_files_are_what_the_writer_writes(tmp_path):
    out = packed(tmp_path, "wds")
    on_disk = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert sorted([wds.INDEX, *_wds_index.named_files(wds.load_index(str(out))["wds"])]) == on_disk
