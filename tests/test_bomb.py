"""Decompression bombs: real images whose header claims 60000x60000 are refused by pack's checks
and by every reader decode path, from the header, before any pixel is allocated."""
from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import pytest
from PIL import Image

from packer.errors import CorruptDataError, PackError
from packer.pack import pack
from readers import (FolderDataset, HDF5Dataset, LMDBDataset, RandomResizedCrop, ResizeCenterCrop, WDSDataset,
                     WDSMapDataset)

from conftest import jpeg_bytes, write

ROOT = Path(__file__).resolve().parents[1]
CLAIMED = 60000 * 60000
PILLOW_LIMIT = 178_956_970  # Pillow refuses above 2 x Image.MAX_IMAGE_PIXELS (its default)
SUFFIX = {"jpeg": "jpg", "png": "png", "bmp": "bmp", "tiff": "tif"}
MAX_RSS_MB = 500


def walk_jpeg_to_sof(data: bytes) -> int:
    pos = 2
    while data[pos + 1] not in (0xC0, 0xC2):
        pos += 2 + struct.unpack_from(">H", data, pos + 2)[0]
    return pos


def jpeg_bomb(width=60000, height=60000) -> bytes:
    """A real baseline JPEG with its SOF0 frame size rewritten; every marker stays valid."""
    data = bytearray(jpeg_bytes(1, size=(64, 48)))
    struct.pack_into(">HH", data, walk_jpeg_to_sof(data) + 5, height, width)
    return bytes(data)


def png_bomb(width=60000, height=60000) -> bytes:
    """A real PNG with its IHDR size rewritten and the IHDR CRC recomputed to match."""
    data = bytearray(jpeg_bytes(2, size=(64, 48), fmt="PNG"))
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(data[12:29]))
    return bytes(data)


def saved_by_pillow(fmt: str) -> bytearray:
    buf = io.BytesIO()
    Image.open(io.BytesIO(jpeg_bytes(3, size=(64, 48)))).save(buf, fmt)
    return bytearray(buf.getvalue())


def bmp_bomb(width=60000, height=60000) -> bytes:
    """A real BMP with the BITMAPINFOHEADER width and height rewritten."""
    data = saved_by_pillow("BMP")
    struct.pack_into("<ii", data, 18, width, height)
    return bytes(data)


def tiff_bomb(width=60000, height=60000) -> bytes:
    """A real little-endian TIFF with its ImageWidth and ImageLength tags rewritten."""
    data = saved_by_pillow("TIFF")
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        entry = ifd + 2 + 12 * i
        tag, kind = struct.unpack_from("<HH", data, entry)
        if tag in (256, 257):
            struct.pack_into("<H" if kind == 3 else "<I", data, entry + 8, width if tag == 256 else height)
    return bytes(data)


BOMBS = {"jpeg": jpeg_bomb, "png": png_bomb, "bmp": bmp_bomb, "tiff": tiff_bomb}


def bomb_tree(root: Path, kinds=tuple(BOMBS)) -> Path:
    """root/good/{0,1}.jpg plus root/zbomb/bomb.<ext> for each kind (labels: good 0, zbomb 1)."""
    for i in range(2):
        write(root / "good" / f"{i}.jpg", jpeg_bytes(10 + i))
    for kind in kinds:
        write(root / "zbomb" / f"bomb.{SUFFIX[kind]}", BOMBS[kind]())
    return root


# Runs packer in a grandchild and prints its peak RSS. A child's ru_maxrss counts the pages
# of the process it was forked from (the test process, torch loaded) until it execs, so the
# peak is read in a small launcher, of its own child. The limits make a regression fail the
# test instead of exhausting the machine.
LAUNCHER = """
import resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
resource.setrlimit(resource.RLIMIT_CPU, (60, 60))
code = subprocess.run([sys.executable, "-m", "packer.cli", *sys.argv[1:]], stdout=subprocess.DEVNULL).returncode
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def run_packer(*args) -> tuple[int, str, float, float]:
    """(exit code, stderr, peak RSS in MB, seconds) of `packer ARGS` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    code, rss_kb = map(int, done.stdout.split())
    return code, done.stderr, rss_kb / 1024, time.perf_counter() - start


def assert_names_the_bomb(message: str, kind: str, limit: int = PILLOW_LIMIT) -> None:
    assert "image too large" in message
    assert f"{limit:,}" in message  # the limit
    # the claimed size: width x height where packer parses the header, Pillow's count for BMP
    assert "60000x60000 = 3,600,000,000 pixels" in message or f"({CLAIMED} pixels)" in message


def test_the_default_limit_is_pillows():
    from packer.check import MAX_PIXELS

    assert MAX_PIXELS == PILLOW_LIMIT == 2 * Image.MAX_IMAGE_PIXELS


@pytest.mark.parametrize("kind", BOMBS)
def test_the_crafted_bombs_are_otherwise_valid_images(kind):
    """A check of the fixtures, not of packer: Pillow parses each header and reads the
    claimed size, so the tests below exercise the limit, not a parse error."""
    with pytest.raises(Image.DecompressionBombError, match=f"{CLAIMED} pixels"):
        Image.open(io.BytesIO(BOMBS[kind]()))


# pack: both checks that read headers refuse, quickly and without allocating


@pytest.mark.parametrize("level", ["header", "full"])
@pytest.mark.parametrize("kind", BOMBS)
def test_pack_fails_on_a_bomb_naming_it_quickly_and_without_allocating(tmp_path, kind, level):
    src = bomb_tree(tmp_path / "src", [kind])
    out = tmp_path / "out.lmdb"
    code, stderr, rss_mb, seconds = run_packer("pack", src, "--to", "lmdb", "-o", out, "--check", level,
                                               "--workers", "2")
    assert code == 1, stderr
    assert f"zbomb/bomb.{SUFFIX[kind]}: image too large" in stderr
    assert_names_the_bomb(stderr, kind)
    assert "--max-pixels" in stderr
    assert rss_mb < MAX_RSS_MB, f"peak RSS {rss_mb:.0f} MB"
    assert seconds < 30
    assert not out.exists()


@pytest.mark.parametrize("level", ["header", "full"])
def test_pack_skips_every_bomb_listing_the_reason(tmp_path, level):
    src = bomb_tree(tmp_path / "src")
    out = tmp_path / "out.h5"
    code, stderr, rss_mb, _ = run_packer("pack", src, "--to", "hdf5", "-o", out, "--check", level,
                                         "--on-error", "skip", "--workers", "2")
    assert code == 0, stderr
    for kind, suffix in SUFFIX.items():
        line = next(l for l in stderr.splitlines() if l.startswith(f"skipped zbomb/bomb.{suffix}:"))
        assert_names_the_bomb(line, kind)
    assert "packed 2 images" in stderr and "4 skipped" in stderr
    assert rss_mb < MAX_RSS_MB, f"peak RSS {rss_mb:.0f} MB"
    from packer.verify import info
    facts = info(str(out))
    assert facts["params"]["max_pixels"] == PILLOW_LIMIT
    assert sorted(s["path"] for s in facts["skipped"]) == sorted(f"zbomb/bomb.{s}" for s in SUFFIX.values())


@pytest.mark.parametrize("kind", BOMBS)
def test_max_pixels_at_the_claimed_size_lets_the_header_check_accept_it(tmp_path, kind):
    src = bomb_tree(tmp_path / "src", [kind])
    code, stderr, _, _ = run_packer("pack", src, "--to", "lmdb", "-o", tmp_path / "below.lmdb",
                                    "--max-pixels", CLAIMED - 1, "--workers", "2")
    assert code == 1 and "image too large" in stderr and f"{CLAIMED - 1:,}" in stderr, stderr
    out = tmp_path / "at.lmdb"
    code, stderr, rss_mb, _ = run_packer("pack", src, "--to", "lmdb", "-o", out, "--max-pixels", CLAIMED,
                                         "--workers", "2")
    assert code == 0, stderr
    assert "packed 3 images" in stderr
    assert rss_mb < MAX_RSS_MB
    from packer.verify import info, verify
    assert info(str(out))["params"]["max_pixels"] == CLAIMED
    assert verify(str(out), check="header", workers=1).ok  # verify holds the pack to its own limit


def test_max_pixels_must_be_a_positive_number(tmp_path):
    src = bomb_tree(tmp_path / "src", ["jpeg"])
    code, stderr, _, _ = run_packer("pack", src, "--to", "lmdb", "--max-pixels", 0)
    assert code == 2 and "--max-pixels" in stderr
    for bad in (0, -1, None, 2.5, True):
        with pytest.raises(PackError, match="max_pixels must be a positive integer"):
            pack(str(src), "lmdb", str(tmp_path / "x.lmdb"), max_pixels=bad)


def test_check_refuses_from_the_header_and_keeps_pillows_warning_out(monkeypatch):
    """Below the limit Pillow's DecompressionBombWarning is not raised through the check;
    the limit, not the warning, is the policy."""
    from packer.check import problem

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    big = bmp_bomb(10000, 10000)  # 1e8 pixels: over Pillow's warning level, under its error level
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert problem(big, "header") is None
        reason = problem(big, "header", 10**8 - 1)
    assert "its header claims 10000x10000 = 100,000,000 pixels" in reason and "99,999,999" in reason
    for kind in BOMBS:
        assert_names_the_bomb(problem(BOMBS[kind](), "header"), kind)


# readers: every decode path refuses a bomb that was packed unchecked


@pytest.fixture(scope="module")
def packed_bombs(tmp_path_factory):
    """The bomb tree packed with --check none into every format (and read as a folder too)."""
    root = tmp_path_factory.mktemp("bombs")
    src = bomb_tree(root / "src")
    outs = {"folder": src}
    for fmt, ext in (("lmdb", ".lmdb"), ("hdf5", ".h5"), ("wds", ".wds")):
        outs[fmt] = Path(pack(str(src), fmt, str(root / f"out{ext}"), check="none", shuffle=False,
                              workers=2).out)
    return outs


DATASETS = {"folder": FolderDataset, "lmdb": LMDBDataset, "hdf5": HDF5Dataset, "wds": WDSMapDataset}


def bomb_indexes(ds) -> dict[str, int]:
    paths = list(ds.paths)
    return {kind: paths.index(f"zbomb/bomb.{suffix}") for kind, suffix in SUFFIX.items()}


@pytest.mark.parametrize("mode", ["pil", "tensor", "numpy"])
@pytest.mark.parametrize("fmt", DATASETS)
def test_every_reader_refuses_a_bomb_in_every_decode_mode(packed_bombs, fmt, mode):
    ds = DATASETS[fmt](packed_bombs[fmt], decode=mode)
    for kind, index in bomb_indexes(ds).items():
        with pytest.raises(CorruptDataError) as info:
            ds[index]
        message = str(info.value)
        assert f"zbomb/bomb.{SUFFIX[kind]}" in message and "max_pixels=" in message
        assert_names_the_bomb(message, kind)
    assert ds[0][1] == 0  # the good images still decode


@pytest.mark.parametrize("transform", [RandomResizedCrop(32), ResizeCenterCrop(32, resize=40)], ids=repr)
@pytest.mark.parametrize("fmt", ["lmdb", "wds"])
def test_decode_aware_crops_refuse_a_bomb_before_decoding(packed_bombs, fmt, transform):
    ds = DATASETS[fmt](packed_bombs[fmt], decode="raw", transform=transform)
    for kind, index in bomb_indexes(ds).items():
        with pytest.raises(CorruptDataError, match=f"zbomb/bomb.{SUFFIX[kind]}: image too large") as info:
            ds[index]
        assert_names_the_bomb(str(info.value), kind)
    assert tuple(ds[0][0].shape) == (3, 32, 32)


@pytest.mark.parametrize("mode", ["pil", "tensor", "numpy"])
def test_streaming_wds_refuses_a_bomb(packed_bombs, mode):
    images = []
    with pytest.raises(CorruptDataError, match="image too large") as info:
        for image, label in WDSDataset(packed_bombs["wds"], decode=mode):
            images.append(label)
    assert "max_pixels=" in str(info.value) and "zbomb/bomb" in str(info.value)
    assert images == [0, 0]


@pytest.mark.parametrize("fmt", DATASETS)
def test_readers_take_a_max_pixels_argument(packed_bombs, fmt):
    ds = DATASETS[fmt](packed_bombs[fmt], decode="numpy", max_pixels=64 * 48 - 1)
    with pytest.raises(CorruptDataError, match="64x48 = 3,072 pixels, over the limit of 3,071"):
        ds[0]
    assert DATASETS[fmt](packed_bombs[fmt], decode="numpy", max_pixels=64 * 48)[0][0].shape == (48, 64, 3)
    for bad in (0, -5, None, 1.5, True):
        with pytest.raises(ValueError, match="max_pixels must be a positive integer"):
            DATASETS[fmt](packed_bombs[fmt], max_pixels=bad)


def test_gpu_decoder_refuses_a_bomb_before_nvjpeg_or_the_cpu_fallback_sees_it(monkeypatch):
    """With a stand-in for torchvision's decode_jpeg (no CUDA here) that fails the test if a
    bomb reaches it: nvJPEG would allocate the claimed size in GPU memory."""
    import types

    import torch

    from readers.decode import decode_tensor
    from readers.nvjpeg import GPUDecoder

    bombs = {BOMBS[kind]() for kind in BOMBS}
    seen = []

    def decode_jpeg(data, mode=None, device=None):
        items = data if isinstance(data, list) else [data]
        assert not any(bytes(t.numpy()) in bombs for t in items), "a bomb reached the GPU decoder"
        seen.extend(items)
        out = [decode_tensor(bytes(t.numpy())) for t in items]
        return out if isinstance(data, list) else out[0]

    fake = types.ModuleType("torchvision.io")
    fake.decode_jpeg, fake.ImageReadMode = decode_jpeg, types.SimpleNamespace(RGB="RGB")
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    monkeypatch.setitem(sys.modules, "torchvision.io", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    gpu = GPUDecoder(ResizeCenterCrop(32, 40), device="cpu")
    good = jpeg_bytes(20)
    assert tuple(gpu([good, good]).shape) == (2, 3, 32, 32) and len(seen) == 2
    for kind in BOMBS:  # JPEG: the nvJPEG path; the others: the CPU fallback
        with pytest.raises(CorruptDataError, match="^image 1 of the batch: image too large") as info:
            gpu([good, BOMBS[kind]()])
        assert_names_the_bomb(str(info.value), kind)
    with pytest.raises(CorruptDataError, match="over the limit of 3,071"):
        GPUDecoder(ResizeCenterCrop(32, 40), device="cpu", max_pixels=64 * 48 - 1)([good])
