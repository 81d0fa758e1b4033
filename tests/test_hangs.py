"""Nothing waits forever on a file that never gives bytes: real FIFOs in a source folder and in
a packed dataset, and a symlink to /dev/zero. Each command runs in a process of its own under
a timeout, so that a regression fails the test instead of hanging the suite."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import jpeg_bytes, write
from packer import pack

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60  # seconds: far above what each command takes, far below forever


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=LIMIT, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(args)} still waiting after {LIMIT} s")


def small_folder(root: Path) -> Path:
    for i in range(4):
        write(root / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(i))
    return root


@pytest.mark.parametrize("odd", ["fifo", "dev_zero"])
def test_doctor_on_a_folder_holding_a_fifo_or_a_link_to_dev_zero_names_it(tmp_path, odd):
    src = small_folder(tmp_path / "src")
    if odd == "fifo":
        os.mkfifo(src / "c0" / "odd.jpg")
    else:
        os.symlink("/dev/zero", src / "c0" / "odd.jpg")
    done = run("-m", "packer", "doctor", str(src), "--seconds", "2", "--workers", "1")
    kind = "FIFO" if odd == "fifo" else "character device"
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"c0/odd.jpg: not a regular file ({kind})" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def wds_with_a_fifo_shard(tmp_path) -> Path:
    out = tmp_path / "w"
    pack(str(small_folder(tmp_path / "src")), "wds", str(out))
    shard = next(out.rglob("*.tar"))
    shard.unlink()
    os.mkfifo(shard)
    return out


def test_a_fifo_in_a_shards_place_is_named_by_the_stream_reader(wds_with_a_fifo_shard):
    code = ("import sys, readers\nfrom packer import CorruptDataError\n"
            "try:\n    list(readers.WDSDataset(sys.argv[1]))\n"
            "except CorruptDataError as exc:\n    print(exc)\n")
    done = run("-c", code, str(wds_with_a_fifo_shard))
    assert done.returncode == 0, done.stderr
    assert "shard-000000.tar: the shard is not a regular file (FIFO)" in done.stdout


def test_doctor_on_a_dataset_with_a_fifo_shard_stops_with_an_error(wds_with_a_fifo_shard):
    done = run("-m", "packer", "doctor", str(wds_with_a_fifo_shard), "--seconds", "2", "--workers", "1")
    assert done.returncode == 1 and "Error: " in done.stderr and str(wds_with_a_fifo_shard) in done.stderr
    assert "Traceback" not in done.stderr
