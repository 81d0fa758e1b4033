"""packer.checksum: record checksum kinds. Every format writes and reads both kinds, packs
written before kinds (or with crc32) keep reading, damage is caught with each kind, and
merge, convert, verify and the streaming reader honour the pack's kind."""
from __future__ import annotations

import json
import os
import shutil
import tarfile
import zlib
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from packer import FORMATS, open_reader, pack
from packer.checksum import DEFAULT, FUNCTIONS, KINDS, record_checksum
from packer.cli import main
from packer.convert import convert
from packer.errors import CorruptDataError, FormatError, PackError
from packer.formats import lmdb as lmdb_format
from packer.formats import read_metadata
from packer.merge import merge
from packer.verify import verify

from conftest import jpeg_bytes, write
from test_fuzz_metadata import read_raw, rewrite_metadata

# Each kind as another tool computes it: zlib's CRC-32; the low 32 bits of xxhash's XXH3-64.
REFERENCE = {"crc32": zlib.crc32, "xxh3": lambda data: xxhash.xxh3_64_intdigest(bytes(data)) & 0xFFFFFFFF}
COUNT = 20  # records, each over a page (LMDB stores them in overflow pages, with extents)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checksum") / "src"
    for i in range(COUNT):
        write(root / f"c{i % 2}" / f"{i:02d}.jpg", jpeg_bytes(i, size=(160, 120)))
    return root


@pytest.fixture(scope="module")
def packs(src, tmp_path_factory) -> dict:
    """{(format, kind): a pack of src}, written once for the module; tests damage copies."""
    folder = tmp_path_factory.mktemp("packs")
    found = {}
    for fmt, target in FORMATS.items():
        for kind in KINDS:
            found[fmt, kind] = folder / f"{kind}{target.extension}"
            pack(str(src), fmt, str(found[fmt, kind]), workers=1, progress=False, checksum=kind)
    return found


def copy_pack(path: Path, tmp_path: Path) -> Path:
    target = tmp_path / path.name
    (shutil.copytree if path.is_dir() else shutil.copyfile)(path, target)
    return target


def flip_a_byte_of(path: Path, data: bytes) -> None:
    """Flip one bit in the middle of the stored copy of data (a record's image bytes)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    where, offset = next((f, f.read_bytes().find(data)) for f in files if f.read_bytes().find(data) >= 0)
    with open(where, "r+b") as f:
        f.seek(offset + len(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_each_kind_is_the_reference_value_for_any_buffer():
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 64, 4097, 110_000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for kind, reference in REFERENCE.items():
            for buffer in (data, bytearray(data), memoryview(data)):
                assert record_checksum(buffer, kind) == reference(data), (kind, size)
    assert DEFAULT == "xxh3" and set(KINDS) == set(REFERENCE)


def test_an_unknown_kind_is_refused_before_packing(src, tmp_path):
    with pytest.raises(PackError, match=r"record checksum kind 'md5' is not one this packer knows \(crc32, xxh3\)"):
        pack(str(src), "lmdb", str(tmp_path / "x.lmdb"), progress=False, checksum="md5")
    assert not (tmp_path / "x.lmdb").exists()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_round_trips_with_each_kind(packs, src, fmt, kind):
    path = packs[fmt, kind]
    meta = read_metadata(path)
    assert meta.checksum == kind and meta.format_version == (1 if kind == "crc32" else 2)
    for check_crc in (True, False):
        reader = open_reader(path, check_crc=check_crc)
        try:
            assert reader.record_checksum is FUNCTIONS[kind]
            for i in range(COUNT):
                data, _, relpath = reader.read(i)
                assert data == (src / relpath).read_bytes()
        finally:
            reader.close()
    report = verify(str(path), against=str(src))
    assert report.ok and report.checked == COUNT, report.problems


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_flipped_image_byte_is_caught_by_reads_and_verify(packs, fmt, kind, tmp_path):
    path = copy_pack(packs[fmt, kind], tmp_path)
    reader = open_reader(path)
    data, _, relpath = reader.read(5)
    reader.close()
    flip_a_byte_of(path, data)
    reader = open_reader(path)
    with _no_stale_warning():
        with pytest.raises(CorruptDataError, match=rf"{relpath}\): checksum mismatch.*its {kind} differs"):
            reader.read(5)
    assert reader.read(4)[0] != data  # the other records still read, at their extents (LMDB)
    if fmt == "lmdb":
        assert reader.extents() is not None  # damage is not taken for stale extents
    reader.close()
    assert open_reader(path, check_crc=False).read(5)[0] != data
    report = verify(str(path))
    assert not report.ok and any("checksum mismatch" in p and relpath in p for p in report.problems), report.problems


class _no_stale_warning:
    """Fails if a RuntimeWarning about stale extents is raised inside the block."""

    def __enter__(self):
        import warnings
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not [w for w in self.caught if "extents do not match" in str(w.message)]
        return False


def strip_to_a_legacy_pack(fmt: str, path: Path) -> None:
    """Make a crc32 pack what packers before kinds wrote: no "checksum" key (already so for
    crc32), and in LMDB no sums table (nor its entry among the table checksums)."""
    assert "checksum" not in json.loads(read_raw(fmt, str(path)))
    if fmt == "lmdb":
        env = lmdb.open(str(path), lock=False, map_size=os.path.getsize(path / "data.mdb") + (1 << 20))
        with env.begin(write=True) as txn:
            assert txn.delete(b"all/sums")
            checksums = json.loads(txn.get(b"all/checksums"))
            del checksums["sums"]
            txn.put(b"all/checksums", json.dumps(checksums).encode())
        env.close()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_pack_from_before_kinds_reads_and_catches_damage(packs, src, fmt, tmp_path):
    path = copy_pack(packs[fmt, "crc32"], tmp_path)
    strip_to_a_legacy_pack(fmt, path)
    meta = read_metadata(path)
    assert meta.checksum == "crc32" and meta.format_version == 1
    reader = open_reader(path)
    if fmt == "lmdb":
        assert reader.record_sums() is False and reader.extents() is not None  # reads check the header's
    assert [reader.read(i)[0] for i in range(COUNT)] == [(src / p).read_bytes() for p in reader.paths]
    data, _, relpath = reader.read(7)
    reader.close()
    flip_a_byte_of(path, data)
    with pytest.raises(CorruptDataError, match=rf"{relpath}\): checksum mismatch"):
        open_reader(path).read(7)
    assert not verify(str(path)).ok


def swap_extents(path: Path, a: int, b: int) -> None:
    """Trade two records' extents (as a database rewritten by another tool leaves them),
    with the table's checksum restamped: only the records' own checks can tell."""
    env = lmdb.open(str(path), lock=False, map_size=os.path.getsize(path / "data.mdb") + (1 << 20))
    with env.begin(write=True) as txn:
        extents = np.frombuffer(txn.get(b"all/extents"), lmdb_format.EXTENT).copy()
        extents[[a, b]] = extents[[b, a]]
        txn.put(b"all/extents", extents.tobytes())
        checksums = json.loads(txn.get(b"all/checksums"))
        checksums["extents"] = zlib.crc32(extents.tobytes())
        txn.put(b"all/checksums", json.dumps(checksums).encode())
    env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_lmdb_stale_extents_are_told_from_damage(packs, src, kind, tmp_path):
    # Records 3 and 4 are not among those the spot check samples when the extents load: the
    # sums check fails at the extent, the header there names another record, so the extents
    # are dropped and the record comes back right through LMDB's map.
    path = copy_pack(packs["lmdb", kind], tmp_path)
    swap_extents(path, 3, 4)
    reader = open_reader(path)
    assert reader.extents() is not None
    with pytest.warns(RuntimeWarning, match="extents do not match"):
        data, _, relpath = reader.read(3)
    assert data == (src / relpath).read_bytes() and reader.extents() is None
    assert [reader.read(i)[0] for i in range(COUNT)] == [(src / p).read_bytes() for p in reader.paths]
    reader.close()


def part_of(src: Path, tmp_path: Path, index: int, kind: str) -> Path:
    out = tmp_path / f"part{index}-{kind}.lmdb"
    pack(str(src), "lmdb", str(out), part=f"{index}/2", workers=1, progress=False, checksum=kind)
    return out


def test_merge_keeps_the_parts_kind_and_refuses_mixed_kinds_by_name(src, tmp_path):
    first, second = part_of(src, tmp_path, 0, "crc32"), part_of(src, tmp_path, 1, "crc32")
    merged = merge([str(second), str(first)], tmp_path / "merged.lmdb", workers=1, progress=False)
    assert merged.metadata.checksum == read_metadata(merged.out).checksum == "crc32"
    assert verify(merged.out, against=str(src)).ok
    odd = part_of(src, tmp_path, 1, "xxh3")
    with pytest.raises(PackError, match=rf"{odd}: its records carry xxh3 checksums, but {first}'s carry crc32"):
        merge([str(first), str(odd)], tmp_path / "mixed.lmdb", workers=1, progress=False)
    assert not (tmp_path / "mixed.lmdb").exists()


def test_pack_in_parts_writes_the_kind_asked_for(src, tmp_path):
    result = pack(str(src), "hdf5", str(tmp_path / "p.h5"), parts=2, workers=1, progress=False, checksum="crc32")
    assert read_metadata(result.out).checksum == "crc32"
    assert verify(result.out, against=str(src)).ok


def test_convert_writes_its_output_kind_whatever_the_input_kind(packs, src, tmp_path):
    there = convert(str(packs["lmdb", "crc32"]), "wds", str(tmp_path / "x.wds"), workers=1, progress=False,
                    checksum="xxh3")
    back = convert(there.out, "hdf5", str(tmp_path / "back.h5"), workers=1, progress=False, checksum="crc32")
    assert read_metadata(there.out).checksum == "xxh3" and read_metadata(back.out).checksum == "crc32"
    for path, kind in ((there.out, "xxh3"), (back.out, "crc32")):
        reader = open_reader(path)
        for i in range(COUNT):
            data, _, relpath = reader.read(i)
            assert data == (src / relpath).read_bytes()
        reader.close()
        assert verify(path, against=str(src)).ok
    # wds: each sample's .json member names its kind, with the reference value
    with tarfile.open(sorted((Path(there.out) / "all").glob("*.tar"))[0]) as tar:
        name = next(n for n in tar.getnames() if n.endswith(".json"))
        member = json.loads(tar.extractfile(name).read())
    assert set(member) == {"xxh3", "label", "path"}
    assert member["xxh3"] == REFERENCE["xxh3"]((src / member["path"]).read_bytes())


def test_the_cli_takes_checksum_for_pack_and_convert_and_info_names_it(src, tmp_path):
    out = tmp_path / "c.lmdb"
    result = CliRunner().invoke(main, ["pack", str(src), "--to", "lmdb", "-o", str(out), "--checksum", "crc32",
                                       "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert read_metadata(out).checksum == "crc32"
    converted = tmp_path / "c.h5"
    result = CliRunner().invoke(main, ["convert", str(out), "--to", "hdf5", "-o", str(converted), "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert read_metadata(converted).checksum == "xxh3"  # the default
    result = CliRunner().invoke(main, ["info", str(converted)])
    assert "format version 2, xxh3 record checksums" in result.output
    result = CliRunner().invoke(main, ["pack", str(src), "--to", "lmdb", "-o", str(tmp_path / "bad.lmdb"),
                                       "--checksum", "md5"])
    assert result.exit_code == 2 and "'md5' is not one of" in result.output


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_unknown_kind_in_metadata_is_a_clear_error(packs, fmt, tmp_path):
    path = copy_pack(packs[fmt, "xxh3"], tmp_path)
    rewrite_metadata(fmt, path, lambda obj: obj.update(checksum="blake3"))
    with pytest.raises(FormatError, match=rf"{path}.*records carry 'blake3' checksums, a kind this packer does not "
                                          r"know \(it knows crc32, xxh3\); upgrade packer"):
        read_metadata(path)
    result = CliRunner().invoke(main, ["verify", str(path)])
    assert result.exit_code == 1 and "'blake3'" in result.stderr
    rewrite_metadata(fmt, path, lambda obj: obj.update(checksum=3))
    with pytest.raises(FormatError, match="checksum is 3, not the name of a record checksum kind"):
        read_metadata(path)
    rewrite_metadata(fmt, path, lambda obj: obj.update(checksum="xxh3", format_version=1))
    with pytest.raises(FormatError, match=r"checksum is 'xxh3' in format version 1 \(it needs version 2\)"):
        read_metadata(path)


@pytest.mark.parametrize("kind", KINDS)
def test_the_streaming_wds_reader_checks_each_kind(packs, src, kind, tmp_path):
    import readers

    path = copy_pack(packs["wds", kind], tmp_path)
    samples = list(readers.WDSDataset(str(path), decode="raw", shuffle=0))
    assert len(samples) == COUNT
    data = open_reader(path).read(2)[0]
    flip_a_byte_of(path, data)
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        list(readers.WDSDataset(str(path), decode="raw", shuffle=0))
    assert len(list(readers.WDSDataset(str(path), decode="raw", shuffle=0, check_crc=False))) == COUNT
