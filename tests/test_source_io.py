"""packer.source_io: every reader of SRC files (pack, verify --against, the folder reader)
reads regular files only, without blocking, and no more than their size."""
import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from packer.errors import BadImageError
from packer.folder import FolderReader
from packer.source_io import read_regular_file

from conftest import jpeg_bytes, needs_prlimit, run_capped, write
from test_pack import within

ROOT = Path(__file__).resolve().parents[1]


def test_a_regular_file_is_read_whole(tmp_path):
    data = jpeg_bytes(1)
    assert read_regular_file(str(write(tmp_path / "a.jpg", data))) == data
    assert read_regular_file(str(write(tmp_path / "empty.jpg", b""))) == b""


def test_fifos_sockets_and_devices_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.jpg")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock.jpg"))
    os.symlink("/dev/zero", tmp_path / "zero.jpg")
    expected = {"pipe.jpg": "FIFO", "sock.jpg": "socket", "zero.jpg": "character device"}
    for name, kind in expected.items():
        with pytest.raises(BadImageError) as refused:
            within(10, read_regular_file, str(tmp_path / name))
        assert refused.value.reason == f"not a regular file ({kind})"


def test_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_regular_file(str(tmp_path / "missing.jpg"))


def test_verify_against_a_source_whose_file_became_a_fifo_reports_it(tmp_path):
    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    write(src / "cat" / "b.jpg", jpeg_bytes(2))
    out = tmp_path / "out.lmdb"
    cli = [sys.executable, "-m", "packer.cli"]
    subprocess.run([*cli, "pack", str(src), "--to", "lmdb", "-o", str(out)], cwd=ROOT, check=True,
                   capture_output=True)
    (src / "cat" / "b.jpg").unlink()
    os.mkfifo(src / "cat" / "b.jpg")
    try:
        result = subprocess.run([*cli, "verify", str(out), "--against", str(src)], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
    finally:
        with contextlib.suppress(OSError):  # releases a reader left blocked on the FIFO
            os.close(os.open(src / "cat" / "b.jpg", os.O_WRONLY | os.O_NONBLOCK))
    assert result.returncode == 1, result.stderr
    assert "error: cat/b.jpg: cannot compare with the source file: not a regular file (FIFO)" in result.stderr


def test_the_folder_reader_refuses_a_fifo_naming_it(tmp_path):
    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    os.mkfifo(src / "cat" / "pipe.jpg")
    reader = FolderReader(str(src))
    assert reader.read(0)[2] == "cat/a.jpg"
    with pytest.raises(BadImageError, match=r"^cat/pipe.jpg: not a regular file \(FIFO\)$"):
        within(10, reader.read, 1)


# Memory: a source read holds the file once, and runs out of memory with packer's error.

def load_capped(tmp_path: Path, path: Path, headroom: int):
    """load_file(path) (what pack runs for each file) under an address-space cap of headroom."""
    return run_capped(tmp_path, "from packer.pack import load_file",
                      "loaded = load_file(sys.argv[1], 'header')\n"
                      "print(len(loaded.data) if loaded.data is not None else loaded.reason)", [str(path)], headroom)


def sparse_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@needs_prlimit
def test_a_source_file_over_2_gib_is_read_holding_it_once(tmp_path):
    """Linux returns at most ~2 GiB a read, so this file comes in two pieces: read into one
    buffer, it fits under a cap of its size plus 256 MiB (joining the pieces held it twice)."""
    size = 2 * 2**30 + 16 * 2**20
    done = load_capped(tmp_path, sparse_file(tmp_path / "huge.jpg", size), size + 256 * 2**20)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("not an image (starts with b'\\x00\\x00")  # read whole, then sniffed


@needs_prlimit
def test_a_source_file_larger_than_memory_is_refused_naming_it(tmp_path):
    """Past the memory it may have, a read is packer's error, never a MemoryError traceback."""
    done = load_capped(tmp_path, sparse_file(tmp_path / "big.jpg", 2**30), 128 * 2**20)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.strip() == f"too large to hold in memory ({2**30} bytes); free memory, or leave the file out of SRC"
