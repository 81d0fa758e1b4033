"""packer.crc: the fast CRC-32 gives zlib's values exactly, so packs written with zlib's
(before, or where the fast wheel is missing) read and verify with the fast one, and damage
is still caught."""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from packer import FORMATS, open_reader
from packer.crc import IMPLEMENTATION, crc32
from packer.errors import CorruptDataError
from packer.formats import read_metadata
from packer.verify import verify

from conftest import class_sorted_tree

REPO = Path(__file__).resolve().parents[1]
SIZES = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4095, 4096,
         4097, 5121, 65536 + 13, 110_000, (1 << 20) + 3]
# Importing packer with deflate hidden, as where its wheel is missing: packer.crc falls back to zlib.
WITHOUT_DEFLATE = "import sys; sys.modules['deflate'] = None\n"


def random_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_the_fast_implementation_is_in_use():
    """deflate (libdeflate) is a core dependency: without it a checked read costs several times more."""
    assert IMPLEMENTATION == "libdeflate"


@pytest.mark.parametrize("size", SIZES)
def test_equals_zlib_for_every_size_and_buffer_type(size):
    data = random_bytes(size, size)
    expected = zlib.crc32(data)
    for buffer in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert crc32(buffer) == expected


def test_equals_zlib_at_unaligned_offsets():
    data = random_bytes(70_000, 1)
    view = memoryview(data)
    for start in range(17):
        for stop in (start, start + 1, start + 33, len(data) - start):
            assert crc32(view[start:stop]) == zlib.crc32(data[start:stop]), (start, stop)


def test_equals_zlib_on_special_patterns():
    for data in (b"\x00" * 100_003, b"\xff" * 100_003, b"123456789"):
        assert crc32(data) == zlib.crc32(data)
    assert crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value (ISO-HDLC)


def test_chains_over_pieces_as_the_hdf5_writer_does():
    """A table written in flushes has the CRC of the whole: crc32(piece, crc so far)."""
    rng = np.random.default_rng(2)
    data = random_bytes(300_000, 2)
    for _ in range(20):
        cuts = np.sort(rng.integers(0, len(data), rng.integers(1, 8)))
        crc = 0
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            crc = crc32(data[a:b], crc)
        assert crc == zlib.crc32(data)
    assert crc32(b"", 0x12345678) == 0x12345678
    assert crc32(b"abc", 0xFFFFFFFF) == zlib.crc32(b"abc", 0xFFFFFFFF)


def test_refuses_what_is_not_bytes():
    with pytest.raises(TypeError):
        crc32("text")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_zlib_fallback_gives_the_same_values():
    sizes = [0, 1, 17, 4097, 110_000]
    code = WITHOUT_DEFLATE + (
        "import numpy as np\nfrom packer import crc\nassert crc.IMPLEMENTATION == 'zlib', crc.IMPLEMENTATION\n"
        f"for n in {sizes}:\n"
        "    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()\n"
        "    print(crc.crc32(data), crc.crc32(data[n // 2:], crc.crc32(data[:n // 2])))\n")
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    expected = [f"{zlib.crc32(random_bytes(n, n))} {zlib.crc32(random_bytes(n, n))}" for n in sizes]
    assert done.stdout.split("\n")[:-1] == expected


@pytest.fixture(scope="module")
def zlib_packs(tmp_path_factory) -> dict[str, Path]:
    """One pack per format, written by packer with zlib's CRC-32 (deflate hidden)."""
    root = tmp_path_factory.mktemp("zlib-packs")
    src = class_sorted_tree(root / "src", classes=3, per_class=4)
    outs = {fmt: root / f"p{FORMATS[fmt].extension}" for fmt in FORMATS}
    code = WITHOUT_DEFLATE + (
        "from packer import crc, pack\nassert crc.IMPLEMENTATION == 'zlib', crc.IMPLEMENTATION\n"
        + "".join(f"pack({str(src)!r}, {fmt!r}, {str(out)!r}, workers=1, progress=False)\n"
                  for fmt, out in outs.items()))
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    return {"src": src, **outs}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_pack_written_with_zlib_reads_checked_with_the_fast_crc(zlib_packs, fmt):
    path, src = zlib_packs[fmt], zlib_packs["src"]
    for split in read_metadata(str(path)).splits:
        reader = open_reader(path, split, check_crc=True)
        try:
            for i in range(len(reader)):
                data, _, relpath = reader.read(i)
                assert data == (src / relpath).read_bytes()
        finally:
            reader.close()
    report = verify(str(path), against=str(src))
    assert report.ok, report.problems


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_flipped_image_byte_is_still_caught(zlib_packs, fmt, tmp_path):
    original = zlib_packs[fmt]
    path = tmp_path / original.name
    copy = subprocess.run(["cp", "-r", str(original), str(path)], capture_output=True)
    assert copy.returncode == 0, copy.stderr
    reader = open_reader(path)
    data, _, relpath = reader.read(5)
    reader.close()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    hits = [(f, f.read_bytes().find(data)) for f in files if f.read_bytes().find(data) >= 0]
    assert hits, "the stored image bytes are expected verbatim in the file"
    where, offset = hits[0]
    with open(where, "r+b") as f:
        f.seek(offset + len(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptDataError, match=rf"{relpath}\): checksum mismatch"):
        open_reader(path).read(5)
    assert open_reader(path, check_crc=False).read(5)[0] != data


def copied_pack(zlib_packs, fmt: str, tmp_path) -> tuple[Path, list[Path]]:
    """A copy of the zlib pack of fmt to damage, and its data files."""
    path = tmp_path / zlib_packs[fmt].name
    copy = subprocess.run(["cp", "-r", str(zlib_packs[fmt]), str(path)], capture_output=True)
    assert copy.returncode == 0, copy.stderr
    return path, [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def flip_a_byte_of(data: bytes, files: list[Path]) -> None:
    """Flip one bit in the middle of the stored copy of a record's image bytes."""
    where, offset = next((f, f.read_bytes().find(data)) for f in files if f.read_bytes().find(data) >= 0)
    blob = bytearray(where.read_bytes())
    blob[offset + len(data) // 2] ^= 0x01
    where.write_bytes(bytes(blob))


@pytest.mark.parametrize("name, fmt", [("lmdb", "lmdb"), ("hdf5", "hdf5"), ("wds (map)", "wds")])
def test_the_benchmarks_checked_measure_reads_with_the_check_on(zlib_packs, name, fmt, tmp_path):
    """benchmarks' checked rows read as Datasets do by default (a damaged record raises); raw rows
    do not check (the same damage reads through)."""
    from benchmarks.run import takes
    from benchmarks.sources import SOURCES

    path, files = copied_pack(zlib_packs, fmt, tmp_path)
    ctx = {"folder": str(zlib_packs["src"]), "packed": {fmt: str(path)}}
    source = SOURCES[name]
    assert len(list(source.samples(ctx, "checked", seed=0))) == len(list(source.samples(ctx, "raw", seed=0))) == 12
    flip_a_byte_of(open_reader(path).read(0)[0], files)
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        list(source.samples(ctx, "checked", seed=0))
    assert len(list(source.samples(ctx, "raw", seed=0))) == 12
    assert takes(source, "checked") and not takes(SOURCES["folder"], "checked") and not takes(SOURCES["wds"], "checked")


@pytest.mark.parametrize("name, fmt", [("lmdb", "lmdb"), ("hdf5", "hdf5"), ("wds (map)", "wds")])
def test_the_checked_measure_times_checked_and_unchecked_reads_of_one_order_block_by_block(zlib_packs, name, fmt,
                                                                                            tmp_path):
    """One pass, read in blocks alternately with the check on and off, reads every record once;
    both sides are timed, and vs_raw is the one side's rate over the other's. The checked side
    checks: a damaged record read there raises."""
    from benchmarks.measures import MEASURES, Options
    from benchmarks.sources import SOURCES

    # 12 records in blocks of 3 (a quarter): checked, raw, raw, checked
    measure, source = MEASURES["checked"], SOURCES[name]
    ctx = {"folder": str(zlib_packs["src"]), "packed": {fmt: str(zlib_packs[fmt])}}
    out = measure.run(source, ctx, Options(), budget=60.0, seed=0, epochs=1)
    assert out["samples"] == 6  # the other 6 were read unchecked
    assert out["raw_rate"] > 0 and out["vs_raw"] == pytest.approx(out["samples"] / out["seconds"] / out["raw_rate"])
    path, files = copied_pack(zlib_packs, fmt, tmp_path)
    reader = open_reader(path)
    records = [reader.read(index)[0] for index in range(len(reader))]
    reader.close()
    for data in records:  # every record damaged: the checked side's first block meets one
        flip_a_byte_of(data, files)
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        measure.run(source, {**ctx, "packed": {fmt: str(path)}}, Options(), budget=60.0, seed=0, epochs=1)
