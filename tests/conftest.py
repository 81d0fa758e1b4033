"""Seeded image trees built on tmp_path: clean, with splits, with traps, and with bad files."""
from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from servers import *  # noqa: F401,F403  (S3 and HTTP servers on loopback: tests/servers.py)

# run_capped's script: the imports, then (measuring) the address space they took, or the body.
CAPPED_SCRIPT = """
import os, sys
{imports}
if os.environ.get("PACKER_TEST_MEASURE"):
    print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmPeak:")))
    sys.exit(0)
{body}
"""

needs_prlimit = pytest.mark.skipif(not shutil.which("prlimit") or not os.path.exists("/proc/self/status"),
                                   reason="needs prlimit (util-linux) and /proc")


def run_capped(tmp_path: Path, imports: str, body: str, args: list[str], headroom: int) -> subprocess.CompletedProcess:
    """The script (imports, then body; sys.argv[1:] is args) in a fresh interpreter whose
    address space is capped (prlimit --as) at what the imports took plus headroom bytes:
    what the body may use. Marked tests need needs_prlimit."""
    script = tmp_path / "capped.py"
    script.write_text(CAPPED_SCRIPT.format(imports=imports, body=body))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # thread stacks out of the baseline
    measured = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True,
                              env={**env, "PACKER_TEST_MEASURE": "1"}, timeout=60)
    cap = int(measured.stdout) * 1024 + headroom
    return subprocess.run(["prlimit", f"--as={cap}", sys.executable, str(script), *args], capture_output=True,
                          text=True, env=env, timeout=120)


# Real data shared beside the checkout (../shared/data), or wherever PACKER_SHARED_DATA points.
SHARED_DATA = Path(os.environ.get("PACKER_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


# The files that take longest (--durations=0 on 2 cores), longest first. pytest-xdist deals whole
# files to its 2 processes in collection order (pyproject's addopts: --dist loadfile
# --no-loadscope-reorder), so these go first and the suite does not end on one long file while
# the other process idles; every other file follows in its usual order.
LONGEST_FIRST = ("test_frameworks.py", "test_elastic.py", "test_gpu_entry.py", "test_threads.py", "test_remote_write.py",
                 "test_stateful_workers.py", "test_wds.py", "test_remote_read.py", "test_benchmarks.py",
                 "test_diagnose.py", "test_heap.py", "test_remote_retry.py", "test_interrupt.py", "test_resume_end.py",
                 "test_resume.py", "test_formats.py", "test_keyed.py", "test_mix_stream.py", "test_trend.py",
                 "test_pool.py", "test_integrity.py", "test_source_io.py")


def pytest_collection_modifyitems(items):
    place = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file's order stays


def pytest_terminal_summary(terminalreporter):
    if not SHARED_DATA.is_dir():
        terminalreporter.write_line(f"shared data: {SHARED_DATA} is absent, so the tests on real images and shards "
                                    "skipped (set PACKER_SHARED_DATA to the folder holding imagenet-sample/ and "
                                    "webdataset-testdata/)")


def jpeg_bytes(seed: int, size=(64, 48), mode: str = "RGB", fmt: str = "JPEG", quality: int = 90) -> bytes:
    rng = np.random.default_rng(seed)
    w, h = size
    channels = {"RGB": 3, "L": 1, "CMYK": 4}[mode]
    pixels = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    im = Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels, mode)
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def cut_with_end_marker(data: bytes) -> bytes:
    """A JPEG cut in half with its end-of-image marker put back: the header check passes it,
    Pillow's decode greys its lower half over, a strict decode refuses it."""
    return data[: len(data) // 2] + b"\xff\xd9"


def noisy_jpeg_444(side: int = 128, seed: int = 0) -> bytes:
    """A 4:4:4 JPEG of noise (no form --baseline-420 keeps, every byte of scan data counts)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90, subsampling=0)
    return buf.getvalue()


def jpeg_12bit(width: int = 16, height: int = 16) -> bytes:
    """A valid 12-bit greyscale JPEG (SOF1, sample precision 12), flat grey, written segment by
    segment (Pillow cannot write one): one-code Huffman tables, each 8x8 block a zero DC
    difference and an end-of-block."""
    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body
    quant = segment(0xDB, b"\x00" + bytes([1] * 64))
    frame = segment(0xC1, bytes([12]) + struct.pack(">HH", height, width) + b"\x01" + b"\x01\x11\x00")
    dc = segment(0xC4, b"\x00" + bytes([1] + [0] * 15) + b"\x00")  # code "0": category 0
    ac = segment(0xC4, b"\x10" + bytes([1] + [0] * 15) + b"\x00")  # code "0": end of block
    scan_header = segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    bits = "00" * (-(-width // 8) * -(-height // 8))
    bits += "1" * (-len(bits) % 8)
    scan = bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))
    return b"\xff\xd8" + quant + frame + dc + ac + scan_header + scan + b"\xff\xd9"


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def tree(root: Path, n: int, seed: int = 0) -> Path:
    """n images in two class folders, c0 and c1."""
    for i in range(n):
        write(root / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(seed + i))
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under folder, by relative path: what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def packed_three_ways(root: Path) -> str:
    """100 tiny JPEGs of 4 classes under root, packed three ways: LMDB in a shuffled storage
    order (so block order goes through it), HDF5 in ImageFolder order, WDS in 12 shards."""
    from packer import pack

    src = class_sorted_tree(root / "src", classes=4, per_class=25)
    pack(str(src), "lmdb", str(root / "d.lmdb"), workers=1, progress=False, shuffle=True, shuffle_seed=1)
    pack(str(src), "hdf5", str(root / "d.h5"), workers=1, progress=False)
    pack(str(src), "wds", str(root / "d.wds"), workers=1, progress=False, options={"max_count": 9})
    return str(root)


def sample_ids(batch) -> list[int]:
    """A collate: each (raw bytes, label) sample's name, the CRC-32 of its bytes; a mixture's
    (raw bytes, label, source), the CRC-32 begun from its source's number + 1."""
    import zlib

    return [zlib.crc32(bytes(sample[0]), sample[2] + 1 if len(sample) == 3 else 0) for sample in batch]


def goes_on(parts: list, along: list) -> bool:
    """Whether the parts, one after another, hold the successive draws of a source's passes
    `along`: a step's draws go to its ranks by source (readers.mix), so each part in any order."""
    ends = [sum(len(p) for p in parts[:k + 1]) for k in range(len(parts))]
    return all(sorted(p) == sorted(along[end - len(p):end]) for p, end in zip(parts, ends))


def class_sorted_tree(root: Path, classes: int, per_class: int) -> Path:
    """ROOT/class<c>/<i>.jpg: classes in runs, each 96x80 JPEG large enough (over a page)
    for LMDB to keep it in overflow pages, so it gets a stored extent."""
    for c in range(classes):
        for i in range(per_class):
            write(root / f"class{c}" / f"{i:02d}.jpg", jpeg_bytes(100 * c + i, size=(96, 80)))
    return root


@pytest.fixture(autouse=True)
def pillow_pixel_limit():
    """Pillow's pixel limit is process-wide and a raised max_pixels raises it (packer.check):
    each test starts from, and leaves, the limit it found."""
    limit = Image.MAX_IMAGE_PIXELS
    yield
    Image.MAX_IMAGE_PIXELS = limit


@pytest.fixture
def image_tree(tmp_path) -> Path:
    """SRC/<class>/... with the traps ImageFolder users meet: odd class names, nesting,
    hidden files, mixed-case extensions, CMYK, grayscale, PNG named .JPEG, non-images."""
    root = tmp_path / "src"
    seed = iter(range(1000))
    for cls in ["cat", "dog house", "v1.2", "ünïcode"]:
        for i in range(3):
            write(root / cls / f"img_{i}.JPEG", jpeg_bytes(next(seed)))
    write(root / "cat" / "nested" / "deeper" / "x.jpg", jpeg_bytes(next(seed)))
    write(root / "cat" / "UPPER.JPG", jpeg_bytes(next(seed)))
    write(root / "cat" / "gray.jpeg", jpeg_bytes(next(seed), mode="L"))
    write(root / "dog house" / "cmyk.jpg", jpeg_bytes(next(seed), mode="CMYK"))
    write(root / "dog house" / "really_png.JPEG", jpeg_bytes(next(seed), fmt="PNG"))
    write(root / "v1.2" / "img.v2.final.jpg", jpeg_bytes(next(seed)))
    write(root / "ünïcode" / "名前 with space.jpg", jpeg_bytes(next(seed)))
    # Ignored: hidden files and folders, non-image extensions.
    write(root / "cat" / "._img_0.JPEG", b"\x00\x05\x16\x07 macOS resource fork")
    write(root / "cat" / ".hidden" / "h.jpg", jpeg_bytes(next(seed)))
    write(root / ".ipynb_checkpoints" / "z.jpg", jpeg_bytes(next(seed)))
    write(root / "dog house" / "notes.txt", b"not an image")
    return root


@pytest.fixture
def split_tree(tmp_path) -> Path:
    """SRC/{train,val}/<class>/...; val lacks one class, so the class list is the union."""
    root = tmp_path / "splits"
    seed = iter(range(2000, 3000))
    for cls in ["a", "b", "c"]:
        for i in range(4):
            write(root / "train" / cls / f"{cls}{i}.jpg", jpeg_bytes(next(seed)))
    for cls in ["a", "c"]:
        for i in range(2):
            write(root / "val" / cls / f"{cls}{i}.jpg", jpeg_bytes(next(seed)))
    return root


@pytest.fixture
def flat_tree(tmp_path) -> Path:
    root = tmp_path / "flat"
    for i in range(5):
        write(root / f"f{i}.jpg", jpeg_bytes(3000 + i))
    return root


BAD_FILES = {
    "empty.jpg": b"",
    "truncated.jpg": None,  # filled in by the fixture: a real JPEG cut in half
    "text.jpg": b"this is a text file, not a JPEG\n",
}


@pytest.fixture
def bad_tree(tmp_path) -> Path:
    """Two good classes plus one bad file of each kind in class 'bad'."""
    root = tmp_path / "bad"
    for i in range(3):
        write(root / "good" / f"g{i}.jpg", jpeg_bytes(4000 + i))
    good = jpeg_bytes(4100, size=(200, 150))
    for name, data in BAD_FILES.items():
        write(root / "bad" / name, data if data is not None else good[: len(good) // 2])
    # Unreadable: a dangling symlink is listed like a file but cannot be opened (even by root).
    os.symlink(root / "missing-target.jpg", root / "bad" / "unreadable.jpg")
    return root


@pytest.fixture
def imagenet_sample() -> Path:
    path = SHARED_DATA / "imagenet-sample"
    if not path.is_dir():
        pytest.skip(f"{path} is not present (set PACKER_SHARED_DATA)")
    return path


def torchvision_samples(root: Path) -> list[tuple[str, int]]:
    """ImageFolder's (path, label) list, per torchvision's find_classes + make_dataset, with
    packer's documented difference: names starting with '.' are ignored."""
    extensions = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    samples = []
    for label, cls in enumerate(classes):
        walked = []
        for dirpath, dirnames, filenames in os.walk(root / cls, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            walked.append((dirpath, filenames))
        for dirpath, filenames in sorted(walked):
            for name in sorted(filenames):
                if name.lower().endswith(extensions) and not name.startswith("."):
                    samples.append((os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"), label))
    return samples
