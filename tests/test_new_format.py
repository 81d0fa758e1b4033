"""A new format is one module, a registry line and its line in docs/layout.md's module map: `flat`,
a small but real format written out in full below, added to packer.formats.FORMATS, goes
through pack, convert (to and from lmdb), verify, info and a DataLoader of its map-style Dataset
without an edit anywhere else in packer or readers. docs/formats.md ("Adding a format") points here
as the worked example."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch.utils.data
from click.testing import CliRunner

import readers
from conftest import SHARED_DATA
from packer.cli import main
from packer.errors import CorruptDataError, FormatError
from packer.formats import FORMATS, Format, detect_format, format_named, open_reader
from packer.formats._foreign import unexpected
from packer.formats._reader import SplitReader
from packer.formats._tables import dataset_identity
from packer.records import Metadata, PathTable
from packer.synth import make_corpus

# ---- the format: what would be packer/formats/flat.py ------------------------------------------
FLAT_LAYOUT = """Flat: every record's bytes back to back in one file, found through a JSON index.

  OUT/records.bin   the image bytes of every record, split after split, each split's
                    records in ImageFolder order, nothing between them
  OUT/flat.json     {"meta": <packer metadata object, sealed with its crc32>,
                     "records": {"<split>": [[offset, length, label, checksum, path], ...]}}

The index is written last, so a folder holding flat.json holds a whole dataset (it is also
the entry an upload copies last). Each record keeps the checksum pack computed (of the
pack's kind), checked on every read unless check_crc=False. The records are in ImageFolder
order, so the writer does not take a shuffled order (writes_shuffled=False)."""

DATA, INDEX = "records.bin", "flat.json"


def detect(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX))


def load_index(path: str) -> dict:
    where = os.path.join(path, INDEX)
    try:
        with open(where, "rb") as f:
            index = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise FormatError(f"{where}: cannot read the flat index ({exc}); re-pack the dataset", path) from exc
    if not isinstance(index, dict) or not isinstance(index.get("records"), dict):
        raise FormatError(f"{where}: not a flat index (no records object); re-pack the dataset", path)
    return index


def read_metadata(path: str) -> Metadata:
    return Metadata.from_dict(load_index(path).get("meta"), os.path.join(path, INDEX))


class Writer:
    def __init__(self, stage: str, options: dict):
        self.stage, self.rows, self.split = stage, {}, None
        self.data = open(os.path.join(stage, DATA), "wb")

    def begin_split(self, name: str, expected_count: int | None = None) -> None:
        self.split, self.rows[name] = name, []

    def add(self, data: bytes, label: int, relpath: str, crc: int) -> None:
        self.rows[self.split].append([self.data.tell(), len(data), label, crc, relpath])
        self.data.write(data)

    def end_split(self, labels, paths, order=None) -> None:
        assert order is None  # writes_shuffled=False: pack adds records in ImageFolder order

    def finish(self, metadata: Metadata) -> None:
        self.data.close()
        with open(os.path.join(self.stage, INDEX), "w") as f:
            json.dump({"meta": metadata.to_dict(), "records": self.rows}, f)

    def abort(self) -> None:
        self.data.close()


class Reader(SplitReader):
    """One split of a flat dataset: rows from flat.json, bytes by pread from records.bin."""

    TABLES = {"_rows": None}

    def __init__(self, path: str, split: str | None = None, check_crc: bool = True, **remote):
        if remote:
            raise FormatError(f"{path}: the flat format reads local folders only", path)
        path = os.path.abspath(path)
        data = os.path.join(path, DATA)
        super().__init__(path, split, check_crc, read_metadata(path), data, dataset_identity(data))
        self._rows = None

    def _open(self) -> int:
        return self.open_identified()

    def _close(self, fd: int) -> None:
        os.close(fd)

    def rows(self) -> list:
        if self._rows is None:
            self._rows = load_index(self.path)["records"][self.split]
        return self._rows

    @property
    def labels(self) -> np.ndarray:
        return np.array([row[2] for row in self.rows()], np.int32)

    @property
    def paths(self) -> PathTable:
        return PathTable.from_strings(row[4] for row in self.rows())

    def read_record(self, index: int) -> tuple[bytes, int]:
        self.check_index(index)
        offset, length, label, crc, _ = self.rows()[index]
        data = os.pread(self.handle(), length, offset)
        if len(data) != length:
            raise CorruptDataError(f"{self.where(index)}: {len(data)} of {length} bytes; re-pack", self.path)
        self.check_data(data, crc, index)
        return data, label


def foreign(path: str, meta: Metadata) -> str | None:
    """Anything in the folder but the two files, which --force must then not replace."""
    return unexpected([os.path.join(path, name) for name in sorted(os.listdir(path)) if name not in (DATA, INDEX)],
                      "flat")


FLAT = Format(name="flat", aliases=("flatbin",), extension=".flat", directory=True, Writer=Writer, Reader=Reader,
              detect=detect, read_metadata=read_metadata, writes_shuffled=False, title="flat",
              held_as=f"a {INDEX}", entry=INDEX, foreign=foreign)

# ---- the test ---------------------------------------------------------------------------------


@pytest.fixture
def flat_format(monkeypatch):
    monkeypatch.setitem(FORMATS, FLAT.name, FLAT)
    return FLAT


@pytest.fixture
def source(tmp_path) -> str:
    """The shared ImageNet sample where present, else a small synthetic ImageFolder tree."""
    sample = SHARED_DATA / "imagenet-sample"
    if sample.is_dir():
        return str(sample)
    make_corpus(str(tmp_path / "synth"), classes=3, per_class=5, seed=1)
    return str(tmp_path / "synth")


def cli(*args: str) -> str:
    # In-process, so the CLI sees the registration; one worker, so a start method other than fork
    # (which would not carry the registration into workers) cannot change what is tested.
    result = CliRunner().invoke(main, [*args, "--workers", "1"] if args[0] != "info" else list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def source_bytes(source: str, reader) -> list[bytes]:
    def read(relpath: str) -> bytes:
        with open(os.path.join(source, relpath), "rb") as f:
            return f.read()
    return [read(reader.paths[i]) for i in range(len(reader))]


def test_a_format_defined_here_goes_through_every_command_and_the_datasets(flat_format, source, tmp_path):
    packed = str(tmp_path / "src.flat")
    cli("pack", source, "--to", "flat", "-o", packed)
    assert detect_format(packed) == "flat" and sorted(os.listdir(packed)) == [INDEX, DATA]
    reader = open_reader(packed)
    expected = source_bytes(source, reader)
    assert [reader.read(i)[0] for i in range(len(reader))] == expected

    info = json.loads(cli("info", packed, "--json"))
    assert info["format"] == "flat" and info["count"] == len(reader)
    cli("verify", packed, "--against", source)

    as_lmdb, back = str(tmp_path / "x.lmdb"), str(tmp_path / "back.flat")
    cli("convert", packed, "--to", "lmdb", "-o", as_lmdb)
    cli("convert", as_lmdb, "--to", "flatbin", "-o", back)  # its alias, as --to takes it
    lmdb_reader, again = open_reader(as_lmdb), open_reader(back)
    assert [lmdb_reader.read(i) for i in range(len(reader))] == [reader.read(i) for i in range(len(reader))]
    assert [again.read(i) for i in range(len(reader))] == [reader.read(i) for i in range(len(reader))]
    cli("verify", back, "--against", source)

    dataset = readers.open_dataset(back, decode="raw")
    assert type(dataset) is readers.PackedDataset and len(dataset) == len(expected)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = [(data, label) for data, label in loader]
    assert got == [(expected[i], int(reader.labels[i])) for i in range(len(expected))]


def test_damage_in_the_new_format_is_found_by_verify_and_the_dataset(flat_format, source, tmp_path):
    packed = str(tmp_path / "src.flat")
    cli("pack", source, "--to", "flat", "-o", packed)
    with open(os.path.join(packed, DATA), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = CliRunner().invoke(main, ["verify", packed, "--workers", "1"])
    assert result.exit_code == 1 and "checksum mismatch" in result.stderr
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        readers.open_dataset(packed, decode="raw")[0]


def test_force_replaces_a_dataset_of_the_new_format_and_nothing_else(flat_format, source, tmp_path):
    packed = str(tmp_path / "src.flat")
    cli("pack", source, "--to", "flat", "-o", packed)
    cli("pack", source, "--to", "flat", "-o", packed, "--force")
    shutil.copy(os.path.join(packed, DATA), os.path.join(packed, "mine.txt"))
    result = CliRunner().invoke(main, ["pack", source, "--to", "flat", "-o", packed, "--force"])
    assert result.exit_code == 1 and "mine.txt, which packer did not write" in result.output


def test_a_format_taken_out_of_the_registry_is_no_format(source, tmp_path, monkeypatch):
    monkeypatch.setitem(FORMATS, FLAT.name, FLAT)
    assert format_named("FlatBin") is FLAT
    monkeypatch.delitem(FORMATS, FLAT.name)
    result = CliRunner().invoke(main, ["pack", source, "--to", "flat", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2 and "'flat' is not a format" in result.output


def test_each_registry_entry_is_keyed_by_its_name_and_no_spelling_names_two_formats():
    spellings = [spelling for key, fmt in FORMATS.items() for spelling in (fmt.name, *fmt.aliases)]
    assert all(key == fmt.name for key, fmt in FORMATS.items())
    assert len(spellings) == len(set(spellings)), spellings


def test_the_new_format_uploads_as_a_folder_format_and_says_it_reads_only_locally(flat_format, source, s3_bucket,
                                                                                  tmp_path):
    """Upload asks the Format alone: flat is a folder with an entry file, so its objects go up with
    flat.json and packer.json last; reading it back by URL needs a read_remote flat does not have."""
    url, options = f"{s3_bucket.url}/sets/ds.flat", json.dumps(s3_bucket.storage_options)
    cli("pack", source, "--to", "flat", "-o", url, "--storage-options", options)
    manifest = json.loads(s3_bucket.client().get_object(Bucket=s3_bucket.name, Key="sets/ds.flat/packer.json")
                          ["Body"].read())
    assert manifest["format"] == "flat" and sorted(manifest["objects"]) == [INDEX, DATA]
    result = CliRunner().invoke(main, ["info", url, "--storage-options", options])
    assert result.exit_code == 1 and "flat datasets are read from local paths only" in result.output
