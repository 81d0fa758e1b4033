"""packer convert: byte-exact between every pair of formats, from the packed data alone, crash-safe."""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer import FORMATS, CorruptDataError, OutputExistsError, PackError, open_reader, pack
from packer.cli import main
from packer.convert import EARLIER, KEPT_CONVERSIONS, convert, converted_output
from packer.formats import detect_format, read_metadata

from conftest import jpeg_bytes, write


def packed(src: Path, fmt: str, folder: Path, **kwargs) -> Path:
    out = folder / f"src{FORMATS[fmt].extension}"
    pack(str(src), fmt, str(out), progress=False, workers=1, **kwargs)
    return out


def records(path: Path) -> dict[str, list]:
    """Every split's records, in stored order, with the split's label and path index."""
    found = {}
    for split in read_metadata(path).splits:
        reader = open_reader(path, split)
        found[split] = [reader.read(i) for i in range(len(reader))]
        assert [r[1] for r in found[split]] == reader.labels.tolist()
        assert [r[2] for r in found[split]] == list(reader.paths)
        reader.close()
    return found


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name]


PAIRS = list(itertools.permutations(FORMATS, 2))


@pytest.mark.parametrize("src_fmt,fmt", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_conversion_keeps_every_record_byte_for_byte(split_tree, tmp_path, src_fmt, fmt):
    source = packed(split_tree, src_fmt, tmp_path)
    out = tmp_path / f"out{FORMATS[fmt].extension}"
    convert(str(source), fmt, str(out), workers=2, progress=False)
    assert detect_format(out) == fmt
    assert records(out) == records(source)
    for split in records(out).values():
        for data, _, relpath in split:
            assert data == (split_tree / relpath).read_bytes()


def test_lmdb_to_hdf5_to_lmdb_round_trip_needs_no_source_folder(bad_tree, tmp_path):
    first = packed(bad_tree, "lmdb", tmp_path, on_error="skip")
    expected = records(first)
    originals = {relpath: data for data, _, relpath in expected["all"]}
    shutil.rmtree(bad_tree)  # convert reads the packed data only
    h5 = tmp_path / "mid.h5"
    back = tmp_path / "back.lmdb"
    convert(str(first), "hdf5", str(h5), workers=1, progress=False)
    convert(str(h5), "lmdb", str(back), workers=2, progress=False)
    assert records(h5) == records(back) == expected
    assert {relpath: data for data, _, relpath in records(back)["all"]} == originals

    before, meta = read_metadata(first), read_metadata(back)
    assert meta.format == "lmdb"
    assert meta.classes == before.classes and meta.source == before.source
    assert meta.skipped == before.skipped and len(meta.skipped) == 4
    assert {n: vars(s) for n, s in meta.splits.items()} == {n: vars(s) for n, s in before.splits.items()}
    origin = meta.params["converted_from"]
    assert origin["path"] == str(h5) and origin["format"] == "hdf5"
    assert origin["params"]["converted_from"]["path"] == str(first)
    assert origin["params"]["converted_from"]["params"]["on_error"] == "skip"


def test_any_number_of_chained_converts_keeps_valid_metadata(tmp_path):
    """Each convert records what it converted, nested: past the nesting cap the metadata was
    refused. The newest KEPT_CONVERSIONS are kept whole, the older ones counted."""
    write(tmp_path / "src" / "a" / "0.jpg", jpeg_bytes(0))
    current = packed(tmp_path / "src", "lmdb", tmp_path)
    chained = 60
    for step in range(chained):
        fmt = ("hdf5", "lmdb")[step % 2]
        out = tmp_path / f"step{step}{FORMATS[fmt].extension}"
        convert(str(current), fmt, str(out), workers=1, progress=False)
        current = out
    meta = read_metadata(current)
    origin, kept = meta.params["converted_from"], 0
    while "converted_from" in origin["params"]:
        kept += 1
        assert origin["path"] == str(tmp_path / f"step{chained - 1 - kept}{FORMATS[origin['format']].extension}")
        origin = origin["params"]["converted_from"]
    assert kept + 1 == KEPT_CONVERSIONS
    assert origin["params"][EARLIER] == chained - KEPT_CONVERSIONS
    assert CliRunner().invoke(main, ["info", str(current)]).exit_code == 0


def test_default_output_replaces_the_extension(image_tree, tmp_path):
    source = packed(image_tree, "lmdb", tmp_path)
    assert converted_output(str(source), "lmdb", "hdf5") == str(tmp_path / "src.h5")
    assert converted_output(str(tmp_path / "plain"), "lmdb", "hdf5") == str(tmp_path / "plain.h5")
    result = CliRunner().invoke(main, ["convert", str(source), "--to", "hdf5", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert "converted 19 images" in result.stderr and (tmp_path / "src.h5").is_file()
    info = CliRunner().invoke(main, ["info", str(tmp_path / "src.h5")])
    assert f"converted from: {source} (lmdb)" in info.stdout


def test_existing_output_and_the_input_itself_are_refused(image_tree, tmp_path):
    source = packed(image_tree, "lmdb", tmp_path)
    out = tmp_path / "o.h5"
    convert(str(source), "hdf5", str(out), workers=1, progress=False)
    with pytest.raises(OutputExistsError, match="pass --force"):
        convert(str(source), "hdf5", str(out), workers=1, progress=False)
    convert(str(source), "hdf5", str(out), workers=1, progress=False, force=True)
    with pytest.raises(PackError, match="would write over it; pass -o"):
        convert(str(source), "lmdb", None, workers=1, force=True, progress=False)
    assert records(source)["all"][0][0] == (image_tree / records(source)["all"][0][2]).read_bytes()
    result = CliRunner().invoke(main, ["convert", str(source), "--to", "zip"])
    assert result.exit_code == 2 and "'zip' is not a format; choose one of" in result.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_damaged_source_fails_naming_the_record_and_leaves_nothing(image_tree, tmp_path, workers):
    source = packed(image_tree, "hdf5", tmp_path)
    target = (image_tree / "cat" / "gray.jpeg").read_bytes()
    blob = bytearray(source.read_bytes())
    offset = blob.find(target)
    blob[offset + 10] ^= 0xFF
    source.write_bytes(bytes(blob))
    out = tmp_path / "out.lmdb"
    with pytest.raises(CorruptDataError, match=r"cat/gray.jpeg\): checksum mismatch"):
        convert(str(source), "lmdb", str(out), workers=workers, progress=False)
    assert not out.exists() and leftovers(tmp_path) == []
    result = CliRunner().invoke(main, ["convert", str(source), "--to", "lmdb", "-o", str(out)])
    assert result.exit_code == 1 and "checksum mismatch" in result.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def test_failure_midway_keeps_the_previous_output(image_tree, tmp_path, monkeypatch):
    source = packed(image_tree, "lmdb", tmp_path)
    out = tmp_path / "out.h5"
    convert(str(source), "hdf5", str(out), workers=1, progress=False)
    before = out.read_bytes()
    calls = []

    def failing_add(self, *args):
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(FORMATS["hdf5"].Writer, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):
        convert(str(source), "hdf5", str(out), workers=1, progress=False, force=True)
    assert out.read_bytes() == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("shuffle", [None, False])
def test_converting_to_wds_shuffles_like_pack_does(image_tree, tmp_path, shuffle):
    lmdb = packed(image_tree, "lmdb", tmp_path)
    direct = tmp_path / "direct.wds"
    pack(str(image_tree), "wds", str(direct), progress=False, workers=1, shuffle=shuffle)
    converted = convert(str(lmdb), "wds", str(tmp_path / "conv.wds"), workers=1, progress=False, shuffle=shuffle)
    assert converted.metadata.params["shuffle_seed"] == (None if shuffle is False else 0)
    # Same seed, same records: the shards hold the same bytes in the same order as a direct pack.
    for name in sorted(p.relative_to(direct) for p in direct.rglob("*.tar")):
        assert (direct / name).read_bytes() == (tmp_path / "conv.wds" / name).read_bytes()


def test_convert_refuses_shard_options_for_other_formats(image_tree, tmp_path):
    lmdb = packed(image_tree, "lmdb", tmp_path)
    result = CliRunner().invoke(main, ["convert", str(lmdb), "--to", "hdf5", "--shard-size", "1MB"])
    assert result.exit_code == 2 and "only for --to wds" in result.stderr
    result = CliRunner().invoke(main, ["convert", str(lmdb), "--to", "wds", "--max-count", "5", "--no-shuffle"])
    assert result.exit_code == 0, result.output
    assert read_metadata(str(lmdb)[:-5] + ".wds").params["max_count"] == 5
