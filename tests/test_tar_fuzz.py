"""Hostile tar shards: every reader of a shard either succeeds or raises CorruptDataError, never hangs.

Seeds are real shards (packer's writer; tarfile in PAX and GNU formats with long names,
directories, links and `./` prefixes; gzip). Each mutant rewrites them the way damage or
an attacker would: flipped bits, header fields rewritten with the checksum recomputed
(so the parser sees them), sizes in octal and base-256 (negative, huge), other type
flags, crafted PAX records, cuts. PACKER_FUZZ_CASES sets the number of mutants (a few
hundred by default; thousands for a report: `PACKER_FUZZ_CASES=5000 pytest -s ...`),
PACKER_FUZZ_SEED the seed.
"""
from __future__ import annotations

import gzip
import io
import os
import random
import re
import shutil
import signal
import tarfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from packer import CorruptDataError, pack
from packer.formats import _tar, wds
from readers import WDSDataset

from conftest import jpeg_bytes, write

CASES = int(os.environ.get("PACKER_FUZZ_CASES", "300"))
SEED = int(os.environ.get("PACKER_FUZZ_SEED", "14"))
SECONDS_PER_CASE = 5  # a small shard parses in milliseconds: longer is a hang


class Hang(Exception):
    pass


@contextmanager
def time_bound(seconds: float, what: str):
    """Fail (instead of hanging the suite) when the body runs longer than seconds."""
    def alarm(signum, frame):
        raise Hang(f"{what}: still running after {seconds} s (a parser loop that does not advance?)")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- header surgery ------------------------------------------------------------------------

SIZE = slice(124, 136)
TYPE = slice(156, 157)


def with_checksum(block: bytearray) -> bytearray:
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)
    return block


def octal(n: int, width: int = 12) -> bytes:
    return (b"%0*o" % (width - 1, n))[-(width - 1):] + b"\0"


def base256(n: int, width: int = 12) -> bytes:
    """GNU's binary number field: 0x80 then big-endian, or 0xff then two's complement."""
    body = width - 1
    return b"\x80" + n.to_bytes(body, "big") if n >= 0 else b"\xff" + (256**body + n).to_bytes(body, "big")


def rewrite(blob: bytes, at: int, field: slice, value: bytes) -> bytes:
    block = bytearray(blob[at:at + 512])
    block[field] = value.ljust(field.stop - field.start, b"\0")[:field.stop - field.start]
    return blob[:at] + bytes(with_checksum(block)) + blob[at + 512:]


def header_offsets(blob: bytes) -> list[int]:
    """Every header block of a valid tar (extended headers too), found by tarfile."""
    offsets = set()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for m in tar.getmembers():
            offsets.update((m.offset, m.offset_data - 512))
    return sorted(offsets)


def pax_record(key: str, value: str, delta: int = 0) -> bytes:
    """One PAX record; delta != 0 declares a wrong length."""
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length + delta).encode() + body


def pax_header(records: bytes) -> bytes:
    block = bytearray(_tar.header("PaxHeaders/x", len(records)))
    block[TYPE] = b"x"
    return bytes(with_checksum(block)) + records + bytes(-len(records) % 512)


# --- seeds ---------------------------------------------------------------------------------

def tar_of(entries: list[tuple[str, bytes | None, bytes]], fmt: int) -> bytes:
    """(name, data or None, type) entries as a tar in format fmt."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = "elsewhere/" + "l" * 120
            info.size = len(data) if data is not None else 0
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("seeds")
    src = root / "src"
    for i in range(6):
        write(src / f"c{i % 2}" / f"img_{i}.jpg", jpeg_bytes(900 + i, size=(12, 12)))
    pack(str(src), "wds", str(root / "p.wds"), workers=1, progress=False)
    packed = next((root / "p.wds" / "all").glob("*.tar")).read_bytes()
    image = jpeg_bytes(1, size=(8, 8))
    long_dir = "deep/" + "d" * 110
    foreign = [
        ("./", None, tarfile.DIRTYPE),
        ("./a", None, tarfile.DIRTYPE),
        ("./a/x.jpg", image, tarfile.REGTYPE),
        ("./a/x.cls", b"1", tarfile.REGTYPE),
        (f"{long_dir}/名前 y.jpg", image, tarfile.REGTYPE),
        (f"{long_dir}/名前 y.cls", b"2", tarfile.REGTYPE),
        ("a/link.jpg", None, tarfile.SYMTYPE),
        ("__meta__.json", b"{}", tarfile.REGTYPE),
        ("z.png", image, tarfile.REGTYPE),
    ]
    seeds = {"packer": packed, "pax": tar_of(foreign, tarfile.PAX_FORMAT), "gnu": tar_of(foreign, tarfile.GNU_FORMAT)}
    seeds["pax-size"] = (pax_header(pax_record("size", str(len(image))) + pax_record("path", "p/q.jpg"))
                         + _tar.header("ignored", len(image)) + image + bytes(-len(image) % 512)
                         + _tar.END_OF_ARCHIVE)
    return seeds


@pytest.fixture(scope="module")
def packer_folder(tmp_path_factory) -> Path:
    """A packed folder whose one shard each case overwrites, for wds.check_files (packer verify)."""
    root = tmp_path_factory.mktemp("folder")
    src = root / "src"
    for i in range(6):
        write(src / f"c{i % 2}" / f"img_{i}.jpg", jpeg_bytes(900 + i, size=(12, 12)))
    pack(str(src), "wds", str(root / "p.wds"), workers=1, progress=False)
    return root / "p.wds"


# --- mutations -----------------------------------------------------------------------------

def size_value(rng: random.Random, blob_length: int) -> tuple[str, bytes]:
    choices = [
        ("octal small", lambda: octal(rng.randrange(0, 2048))),
        ("octal past the end", lambda: octal(blob_length + rng.randrange(1, 10**6))),
        ("octal max", lambda: octal(8**11 - 1)),
        ("octal garbage", lambda: bytes(rng.choice(b"0123456789 x\0") for _ in range(12))),
        ("base-256 small", lambda: base256(rng.randrange(0, 4096))),
        ("base-256 2^60", lambda: base256(2**60)),
        ("base-256 2^87", lambda: base256(2**87 - 1)),
        ("base-256 negative -1", lambda: base256(-1)),
        ("base-256 negative -512", lambda: base256(-512)),
        ("base-256 negative huge", lambda: base256(-(2**80))),
        ("base-256 negative random", lambda: base256(-rng.randrange(1, 10**9))),
    ]
    name, make = rng.choice(choices)
    return name, make()


def pax_records(rng: random.Random) -> tuple[str, bytes]:
    name = rng.choice(["a/b.jpg", "x" * 300 + ".jpg", "ü/名前.png", ""])
    size = rng.choice(["0", "12", "1000000000000000000", "-5", "1e3", " 12", "١٢", "", "9" * 30, "0x10", "1_0"])
    choices = [
        ("path record", lambda: pax_record("path", name)),
        ("size record", lambda: pax_record("size", size)),
        ("path and size", lambda: pax_record("path", name) + pax_record("size", size)),
        ("length 0", lambda: b"0 path=" + name.encode() + b"\n"),
        ("length off", lambda: pax_record("path", name, rng.choice([-3, -1, 1, 2, 1000, -10**6]))),
        ("length huge", lambda: b"999999999 path=x\n"),
        ("length not digits", lambda: b"ab path=x\n"),
        ("no space", lambda: b"12path=x.jpg\n"),
        ("no equals", lambda: b"11 pathx.jpg\n"),
        ("no newline", lambda: b"12 path=x.jpgX"),
        ("empty key", lambda: b"9 =x.jpg\n"),
        ("trailing garbage", lambda: pax_record("path", name) + b"garbage"),
        ("random bytes", lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))),
    ]
    label, make = rng.choice(choices)
    return label, make()


def mutate(rng: random.Random, blob: bytes) -> tuple[str, bytes]:
    """One mutant of a valid tar, and what was done (to reproduce a failure)."""
    headers = header_offsets(blob)
    kind = rng.choice(["flip", "flip header", "size", "size", "type", "field", "pax", "pax", "truncate"])
    at = rng.choice(headers)
    if kind == "flip" or kind == "flip header":
        out = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(out)) if kind == "flip" else at + rng.randrange(512)
            out[pos] ^= 1 << rng.randrange(8)
        return f"{kind} near byte {at}", bytes(out)
    if kind == "size":
        name, value = size_value(rng, len(blob))
        return f"size {name} at header {at}", rewrite(blob, at, SIZE, value)
    if kind == "type":
        flag = rng.choice(b"0125LKxgXSD7V\0Z")
        return f"type {chr(flag)!r} at header {at}", rewrite(blob, at, TYPE, bytes([flag]))
    if kind == "field":
        start, stop = rng.choice([(0, 100), (100, 108), (136, 148), (257, 265), (345, 500)])
        value = bytes(rng.randrange(256) for _ in range(stop - start))
        return f"field {start}:{stop} at header {at}", rewrite(blob, at, slice(start, stop), value)
    if kind == "pax":
        label, records = pax_records(rng)
        return f"PAX {label} {records[:40]!r} before header {at}", blob[:at] + pax_header(records) + blob[at:]
    cut = rng.choice([rng.randrange(len(blob)), rng.randrange(len(blob) // 512) * 512])
    return f"cut at {cut}", blob[:cut]


# --- the readers under test ----------------------------------------------------------------

def read_every_way(shard: Path, folder: Path | None) -> None:
    """Each reader of a shard, to the end; anything but CorruptDataError propagates."""
    list(_tar.iter_samples(str(shard)))
    list(_tar.iter_samples(str(shard), read_data=False))
    _tar.count_samples(str(shard))
    list(WDSDataset(shard, decode="raw"))
    if folder is not None:
        assert all(isinstance(p, str) for p in wds.check_files(str(folder)))
        list(WDSDataset(folder, decode="raw"))


def outcome(shard: Path, folder: Path | None, what: str) -> str:
    with time_bound(SECONDS_PER_CASE, what):
        try:
            read_every_way(shard, folder)
        except CorruptDataError as exc:
            named = shard.name in str(exc) or (folder is not None and "shard-000000.tar" in str(exc))
            assert named, f"{what}: the error does not name the shard: {exc}"
            return "CorruptDataError"
        except Hang:
            raise
        except Exception as exc:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"{what}: {type(exc).__name__} escaped: {exc}") from exc
    return "read"


def test_mutated_shards_raise_corrupt_data_error_or_read(seeds, packer_folder, tmp_path):
    rng = random.Random(SEED)
    folder_shard = next((packer_folder / "all").glob("*.tar"))
    outcomes, kinds = Counter(), Counter()
    started = time.perf_counter()
    for case in range(CASES):
        seed_name = rng.choice(sorted(seeds))
        what, blob = mutate(rng, seeds[seed_name])
        compress = rng.random() < 0.2
        if compress:
            blob = gzip.compress(blob, mtime=0)
            if rng.random() < 0.3:  # damage the compressed stream itself
                blob = blob[:rng.randrange(len(blob))] if rng.random() < 0.5 else flip_one(rng, blob)
        what = f"case {case} (seed {SEED}): {seed_name}{' gzip' if compress else ''}, {what}"
        shard = tmp_path / ("case.tgz" if compress else "case.tar")
        shard.write_bytes(blob)
        folder = None
        if seed_name == "packer" and not compress:
            shutil.copyfile(shard, folder_shard)
            folder = packer_folder
        outcomes[outcome(shard, folder, what)] += 1
        kinds[what.split(", ")[1].split(" ")[0]] += 1
    elapsed = time.perf_counter() - started
    print(f"\ntar fuzz: {CASES} cases in {elapsed:.1f} s: {dict(outcomes)}; mutations {dict(kinds)}")
    assert outcomes["CorruptDataError"] > CASES // 4  # the mutations do reach the parser


def flip_one(rng: random.Random, blob: bytes) -> bytes:
    out = bytearray(blob)
    out[rng.randrange(10, len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


# --- the cases found by hand, each with its message -----------------------------------------

def shard_with(tmp_path: Path, name: str, blob: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def directory_then_image(dir_size: bytes) -> bytes:
    image = jpeg_bytes(3, size=(8, 8))
    folder = bytearray(_tar.header("d", 0))
    folder[TYPE] = b"5"
    folder[SIZE] = dir_size
    member, _ = _tar.member("d/x.jpg", image)
    return bytes(with_checksum(folder)) + member + _tar.END_OF_ARCHIVE


def expect_corrupt(shard: Path, pattern: str) -> None:
    for read in (lambda: list(_tar.iter_samples(str(shard))), lambda: _tar.count_samples(str(shard)),
                 lambda: list(WDSDataset(shard, decode="raw"))):
        with time_bound(SECONDS_PER_CASE, str(shard)), pytest.raises(CorruptDataError, match=pattern):
            read()


def test_negative_base256_size_on_a_directory_does_not_loop(tmp_path):
    shard = shard_with(tmp_path, "neg.tar", directory_then_image(base256(-512)))
    expect_corrupt(shard, r"neg\.tar: the tar header at byte 0 declares size -512; the shard is damaged "
                          r"\(re-create it, or read with on_error='skip'\)")


def test_a_directory_with_a_size_has_no_data_as_in_tarfile(tmp_path):
    shard = shard_with(tmp_path, "dir.tar", directory_then_image(octal(512)))
    assert [s.key for s in _tar.iter_samples(str(shard))] == ["d/x"]


@pytest.mark.parametrize("records, pattern", [
    (b"0 path=x.jpg\n", r"bad PAX record at byte 0 of the extended header at byte 0 \(b'0 path"),
    (b"3 path=x.jpg\n", r"bad PAX record at byte 0"),
    (b"99 path=x.jpg\n", r"bad PAX record at byte 0"),
    (b"12 path=x.jpgX", r"bad PAX record at byte 0"),
    (b"no length\n", r"bad PAX record at byte 0"),
    (b"9 =x.jpg\n", r"PAX record without a key at byte 0"),
    (pax_record("size", "1000000000000000000"), r"truncated at byte \d+: the file ends inside the member 'x\.jpg' "
                                                r"that starts at byte 1536 and needs 1000000000000000000 bytes"),
    (pax_record("size", "-5"), r"PAX size '-5' for the header at byte 1024 is not a byte count"),
    (pax_record("size", "1e3"), r"PAX size '1e3' .* is not a byte count"),
    (pax_record("size", "١٢"), r"PAX size '١٢' .* is not a byte count"),
])
def test_crafted_pax_records_are_refused_naming_the_offset(tmp_path, records, pattern):
    image = jpeg_bytes(4, size=(8, 8))
    shard = shard_with(tmp_path, "pax.tar", pax_header(records) + _tar.member("x.jpg", image)[0] + _tar.END_OF_ARCHIVE)
    expect_corrupt(shard, r"pax\.tar: " + pattern)


@pytest.mark.parametrize("size, pattern", [
    (base256(2**60), r"needs 1152921504606846976 bytes"),
    (base256(2**87 - 1), r"the tar header at byte 0 declares size 154742504910672534362390527"),
    (octal(8**11 - 1), r"needs 8589934592 bytes"),
])
def test_sizes_past_the_end_fail_before_any_allocation(tmp_path, size, pattern):
    blob = rewrite(_tar.member("x.jpg", jpeg_bytes(5, size=(8, 8)))[0] + _tar.END_OF_ARCHIVE, 0, SIZE, size)
    for name, data in (("big.tar", blob), ("big.tgz", gzip.compress(blob))):
        shard = shard_with(tmp_path, name, data)
        expect_corrupt(shard, rf"big\.t.*({pattern}|truncated at byte \d+: the file ends inside the member)")


class Unseekable(io.RawIOBase):
    """A file read as a remote shard is streamed: forward only."""

    def __init__(self, path):
        self.file = open(path, "rb")

    def readable(self):
        return True

    def readinto(self, buffer):
        return self.file.readinto(buffer)

    def close(self):
        self.file.close()
        super().close()


def test_a_gzip_bomb_is_refused_before_it_fills_memory(tmp_path):
    """96 MiB of zeros as one image member gzips to ~100 KB: past 64 MiB at over 100x it is
    refused, naming the shard and the member, having held little more than the floor."""
    import tracemalloc
    bomb = _tar.member("x.jpg", bytes(96 << 20))[0] + _tar.END_OF_ARCHIVE
    shard = shard_with(tmp_path, "bomb.tgz", gzip.compress(bomb, compresslevel=1, mtime=0))
    del bomb
    assert shard.stat().st_size < 1 << 20
    pattern = (r"bomb\.tgz \(gzip\): the member 'x\.jpg' at byte 512 inflates to more than \d+ bytes from \d+ "
               r"compressed: over 100x is a decompression bomb")
    for read in (lambda: list(_tar.iter_samples(str(shard))), lambda: list(WDSDataset(shard, decode="raw")),
                 lambda: list(_tar.iter_samples(str(shard), opener=Unseekable))):
        tracemalloc.start()
        try:
            with time_bound(4 * SECONDS_PER_CASE, str(shard)), pytest.raises(CorruptDataError, match=pattern):
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 * _tar.BOMB_FLOOR + (8 << 20)  # the chunks held, then joined: not the 96 MiB
    assert _tar.count_samples(str(shard)) == 1  # counting holds nothing, so it reads through


def test_compressible_members_under_the_floor_and_incompressible_ones_past_it_read(tmp_path):
    zeros, noise = bytes(8 << 20), random.Random(0).randbytes(72 << 20)
    blob = _tar.member("a.jpg", zeros)[0] + _tar.member("b.jpg", noise)[0] + _tar.END_OF_ARCHIVE
    shard = shard_with(tmp_path, "fine.tgz", gzip.compress(blob, compresslevel=1, mtime=0))
    samples = list(_tar.iter_samples(str(shard)))
    assert [s.key for s in samples] == ["a", "b"]
    assert samples[0].parts["jpg"] == zeros and samples[1].parts["jpg"] == noise


def test_an_oversized_extended_header_is_refused(tmp_path):
    records = pax_record("comment", "c" * (2 << 20))
    shard = shard_with(tmp_path, "ext.tar", pax_header(records) + _tar.END_OF_ARCHIVE)
    expect_corrupt(shard, r"ext\.tar: extended header at byte 0 declares \d+ bytes, more than 1048576")


def test_skip_mode_leaves_out_a_hostile_foreign_shard_with_a_warning(tmp_path):
    good = shard_with(tmp_path, "a-good.tar", _tar.member("k.jpg", jpeg_bytes(6, size=(8, 8)))[0] + _tar.END_OF_ARCHIVE)
    bad = shard_with(tmp_path, "b-bad.tar", directory_then_image(base256(-512)))
    pax = shard_with(tmp_path, "c-pax.tar", pax_header(b"0 path=x\n") + good.read_bytes())
    with time_bound(SECONDS_PER_CASE, "skip"), pytest.warns(RuntimeWarning) as caught:
        ds = WDSDataset([good, bad, pax], decode="raw", on_error="skip")
        assert len(list(ds)) == 1
    messages = [str(w.message) for w in caught]
    assert any("b-bad.tar" in m and "skipped this shard" in m for m in messages)
    assert any("c-pax.tar" in m and "skipped this shard" in m for m in messages)


def test_skip_mode_skips_a_packer_shard_damaged_after_packing(packer_folder, seeds, tmp_path):
    folder = tmp_path / "p.wds"
    shutil.copytree(packer_folder, folder)
    shard = next((folder / "all").glob("*.tar"))
    blob = seeds["packer"]
    # The third sample's first header: the first sample is read, the second is still open.
    clean = list(WDSDataset(folder, decode="raw"))
    shard.write_bytes(rewrite(blob, header_offsets(blob)[6], SIZE, base256(-(2**80))))
    # The shard alone (no index to count or read by): counting it finds the damage.
    with time_bound(SECONDS_PER_CASE, "skip"), pytest.warns(RuntimeWarning, match=r"shard-000000\.tar: the tar "
                                                             r"header at byte \d+ declares size -\d+.*left out"):
        assert list(WDSDataset([str(shard)], decode="raw", on_error="skip")) == []
    # Streamed by the folder's index, the images (each checked against records.bin) are
    # all there: a damaged header costs no sample, and verify names it.
    assert list(WDSDataset(folder, decode="raw", on_error="fail")) == clean and len(clean) == 6
    problems = wds.check_files(str(folder))
    assert any("declares size" in p for p in problems)


# --- the plain-header fast path against tarfile's parser -------------------------------------

def other_writers() -> dict[str, bytes]:
    """Tars from Python's tarfile in each format: `./` prefixes, a directory, a symlink, a
    non-ASCII name, a name long enough for a ustar prefix."""
    image = jpeg_bytes(7, size=(8, 8))
    entries = [
        ("./", None, tarfile.DIRTYPE),
        ("./a/x.jpg", image, tarfile.REGTYPE),
        ("./a/x.cls", b"1", tarfile.REGTYPE),
        ("b", None, tarfile.DIRTYPE),
        ("b/été.jpg", image, tarfile.REGTYPE),
        ("b/link.jpg", None, tarfile.SYMTYPE),
        ("p" * 120 + "/y.jpg", image, tarfile.REGTYPE),
        ("z.png", b"", tarfile.REGTYPE),
    ]
    blobs = {}
    for label, fmt in (("ustar", tarfile.USTAR_FORMAT), ("gnu", tarfile.GNU_FORMAT), ("pax", tarfile.PAX_FORMAT)):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for name, data, kind in entries:
                info = tarfile.TarInfo(name)
                info.type, info.linkname, info.size = kind, "x.jpg" if kind == tarfile.SYMTYPE else "", len(data or b"")
                tar.addfile(info, io.BytesIO(data) if data is not None else None)
        blobs[label] = buf.getvalue()
    return blobs


def general_path_only(monkeypatch) -> None:
    """Every header through tarfile's parser, as before the fast path existed."""
    monkeypatch.setattr(_tar, "plain_header", lambda block: None)


def samples_or_error(shard: Path, read_data: bool = True):
    try:
        return [(s.key, s.offset, s.parts) for s in _tar.iter_samples(str(shard), read_data)]
    except CorruptDataError as exc:
        return f"CorruptDataError: {exc}"


def both_paths(shard: Path, read_data: bool = True) -> tuple:
    fast = samples_or_error(shard, read_data)
    with pytest.MonkeyPatch.context() as monkeypatch:
        general_path_only(monkeypatch)
        return fast, samples_or_error(shard, read_data)


def test_plain_headers_read_as_tarfile_reads_them(seeds):
    """Every header block of packer's and other writers' shards: where the fast path answers,
    tarfile's parser gives the same name, size and a regular-file type."""
    blobs = {**other_writers(), "packer": seeds["packer"], "fuzz-pax": seeds["pax"], "fuzz-gnu": seeds["gnu"]}
    fast_names = Counter()
    for label, blob in blobs.items():
        for at in header_offsets(blob):
            block = blob[at:at + 512]
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            plain = _tar.plain_header(block)
            if plain is None:
                assert label != "packer", f"packer's header at byte {at} ({info.name!r}) went the slow way"
                continue
            assert plain == (info.name, info.size), f"{label} at byte {at}"
            assert info.type == tarfile.REGTYPE and info.isreg()
            fast_names[label] += 1
    # The fast path did run on each writer's plain members, and not on anything else.
    assert dict(fast_names) == {"packer": 18, "ustar": 4, "gnu": 5, "pax": 5, "fuzz-pax": 6, "fuzz-gnu": 6}


def test_fast_and_general_paths_give_the_same_members(seeds, tmp_path):
    """Names, bytes, offsets and grouping: identical whichever path parses the headers."""
    for label, blob in {**other_writers(), **seeds}.items():
        for name, data in ((f"{label}.tar", blob), (f"{label}.tgz", gzip.compress(blob, mtime=0))):
            shard = shard_with(tmp_path, name, data)
            for read_data in (True, False):
                fast, general = both_paths(shard, read_data)
                assert not isinstance(fast, str), f"{name}: {fast}"
                assert fast == general, name
    keys = [key for key, _, _ in both_paths(shard_with(tmp_path, "u.tar", other_writers()["ustar"]))[0]]
    assert keys == ["a/x", "b/été", "p" * 120 + "/y", "z"]


def test_damaged_shards_fail_alike_on_both_paths(seeds, tmp_path):
    """Mutants of every seed: the same samples, or the same CorruptDataError, on both paths."""
    rng = random.Random(SEED + 1)
    blobs = {**other_writers(), **seeds}
    errors = 0
    for case in range(max(CASES // 2, 50)):
        label = rng.choice(sorted(blobs))
        what, blob = mutate(rng, blobs[label])
        shard = shard_with(tmp_path, "case.tar", blob)
        read_data = rng.random() < 0.8
        with time_bound(SECONDS_PER_CASE, what):
            fast, general = both_paths(shard, read_data)
        assert fast == general, f"case {case} ({label}, {what})"
        errors += isinstance(fast, str)
    assert errors > 10  # the mutants do reach the parsers


def packer_shard_with_second_header(seeds, tmp_path: Path, field: slice, value: bytes, checksum: bool = True):
    blob = seeds["packer"]
    at = header_offsets(blob)[3]  # the second sample's first header
    if checksum:
        return shard_with(tmp_path, "shard.tar", rewrite(blob, at, field, value)), at
    block = bytearray(blob[at:at + 512])
    block[field] = value
    return shard_with(tmp_path, "shard.tar", blob[:at] + bytes(block) + blob[at + 512:]), at


@pytest.mark.parametrize("field, value, checksum, message", [
    (slice(0, 1), b"Q", False, "no valid tar header at byte {at} \\(bad checksum\\)"),
    (SIZE, b"0000000x100\0", True, "no valid tar header at byte {at} \\(invalid header\\)"),
    (SIZE, b"-0000000001\0", True, "the tar header at byte {at} declares size -1"),
    (SIZE, base256(-512), True, "the tar header at byte {at} declares size -512"),
    (SIZE, base256(2**87 - 1), True, "the tar header at byte {at} declares size 154742504910672534362390527"),
    (SIZE, octal(8**11 - 1), True, "truncated at byte \\d+: the file ends inside the member '[^']+' that starts "
                                   "at byte {data} and needs 8589934592 bytes"),
    (slice(136, 148), b"0000000x000\0", True, "no valid tar header at byte {at} \\(invalid header\\)"),
])
def test_a_damaged_plain_header_fails_as_before(seeds, tmp_path, field, value, checksum, message):
    shard, at = packer_shard_with_second_header(seeds, tmp_path, field, value, checksum)
    fast, general = both_paths(shard)
    assert fast == general
    pattern = message.format(at=at, data=at + 512)
    assert fast.startswith("CorruptDataError: ") and re.search(rf"shard\.tar: {pattern}", fast), fast
