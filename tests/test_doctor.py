"""packer doctor on real images as a folder and packed, on a cold folder behind a throttled
disk (a real slow read path), and on bad input."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import jpeg_bytes, write
from packer import pack
from packer.cli import main
from packer.doctor import untrusted
from packer.load import BUSY_SHARE

ROOT = Path(__file__).resolve().parents[1]
BLKIO = Path("/sys/fs/cgroup/blkio")


def doctor(*args) -> dict:
    result = CliRunner().invoke(main, ["doctor", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def sample_lmdb(imagenet_sample, tmp_path) -> Path:
    out = tmp_path / "sample.lmdb"
    pack(str(imagenet_sample), "lmdb", str(out))
    return out


def test_real_images_as_a_folder(imagenet_sample):
    report = doctor(imagenet_sample, "--seconds", 3, "--workers", 2)
    assert report["kind"] == "folder" and report["records"] == 125
    assert set(report["stages"]) <= {"cold_read", "warm_read", "decode", "decode_crop"}
    assert {"warm_read", "decode", "decode_crop"} <= set(report["stages"])
    assert report["limit"] in report["stages"]
    assert all(s["samples_per_s"] > 0 for s in report["stages"].values())
    assert report["ceiling_samples_per_s"] > 0
    assert report["machine"]["usable_cores"] >= 1
    assert set(report["load"]) == {"before", "after"} and isinstance(report["untrusted"], list)
    assert report["load"]["before"]["cores"] == report["machine"]["usable_cores"]
    assert all(set(f) == {"setting", "evidence", "fix"} for f in report["findings"])


def load_of(one: float, cores: int = 2) -> dict:
    return {"load_1min": one, "load_5min": one, "cores": cores, "other_load": one,
            "trusted": one <= BUSY_SHARE * cores}


def test_figures_from_a_busy_machine_are_not_trusted():
    # What doctor measured at a load of 3.4 on 2 cores: a whole read over both below one core's
    report = {"load": {"before": load_of(3.4), "after": load_of(3.1)}, "ceiling_samples_per_s": 201,
              "workers": 2, "stages": {"checked_read": {"samples_per_s": 2000}, "decode_crop": {"samples_per_s": 290}}}
    why = untrusted(report, "checked_read")
    assert len(why) == 2 and "a load of 3.4 before the run, 3.1 after the run" in why[0] and "below the 253" in why[1]
    report.update(load={"before": load_of(0.2), "after": load_of(0.8)}, ceiling_samples_per_s=480)
    assert untrusted(report, "checked_read") == []


def test_real_images_packed(sample_lmdb):
    report = doctor(sample_lmdb, "--seconds", 3, "--workers", 1)
    assert report["kind"] == "lmdb"
    assert "checked_read" in report["stages"]
    # 125 real images read, checked, decoded and cropped: decode + crop costs far more than reading
    assert report["limit"] == "decode_crop"
    text = CliRunner().invoke(main, ["doctor", str(sample_lmdb), "--seconds", "2", "--workers", "1"])
    assert text.exit_code == 0 and "<- limit" in text.output and "ceiling:" in text.output


def test_a_target_above_the_ceiling_names_what_it_takes(sample_lmdb):
    report = doctor(sample_lmdb, "--seconds", 2, "--workers", 1, "--target-rate", 1e6)
    assert "target_rate" in [f["setting"] for f in report["findings"]]


def test_a_missing_path_is_a_usage_error():
    result = CliRunner().invoke(main, ["doctor", "/no/such/dataset"])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_a_file_that_is_no_dataset_is_named(tmp_path):
    junk = write(tmp_path / "x.h5", b"not hdf5")
    result = CliRunner().invoke(main, ["doctor", str(junk)])
    assert result.exit_code == 1 and f"{junk}: not a packed dataset" in result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_a_damaged_lmdb_is_named_without_a_traceback(sample_lmdb):
    data = sample_lmdb / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:  # a run of garbage over the middle: B-tree pages among the records
        f.seek(size // 2 // 4096 * 4096)
        f.write(random.Random(0).randbytes(size // 4))
    result = CliRunner().invoke(main, ["doctor", str(sample_lmdb), "--seconds", "2", "--workers", "1"])
    assert result.exit_code == 1 and "damaged" in result.output, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)


def whole_disk(path: Path) -> str | None:
    """MAJOR:MINOR of the disk holding path (blkio throttles whole disks), or None off a block device."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysfs.exists():
        return None
    if (sysfs / "partition").exists():
        sysfs = sysfs.resolve().parent
    return (sysfs / "dev").read_text().strip()


@pytest.fixture
def throttled_cgroup(tmp_path):
    """A cgroup v1 blkio group allowing 100 reads a second from tmp_path's disk."""
    disk = whole_disk(tmp_path)
    if os.geteuid() != 0 or not BLKIO.is_dir() or disk is None:
        pytest.skip("throttling a disk needs root, cgroup v1's blkio controller and tmp_path on a block device")
    group = BLKIO / f"packer-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "blkio.throttle.read_iops_device").write_text(f"{disk} 100")
    except OSError as exc:
        group.exists() and group.rmdir()
        pytest.skip(f"cannot throttle {disk} here: {exc}")
    yield group
    group.rmdir()


def test_a_cold_folder_on_a_slow_read_path_is_named(tmp_path, throttled_cgroup):
    src = tmp_path / "src"
    for i in range(200):
        write(src / f"c{i % 4}" / f"{i:03d}.jpg", jpeg_bytes(i, size=(160, 120)))
    procs = throttled_cgroup / "cgroup.procs"
    proc = subprocess.run([sys.executable, "-m", "packer", "doctor", str(src), "--seconds", "2", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: procs.write_text(str(os.getpid())))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["limit"] == "cold_read", report["stages"]
    assert [f["setting"] for f in report["findings"]] == ["format"]
    assert "packer pack" in report["findings"][0]["fix"]


def test_a_folder_with_splits_is_measured_on_train_or_the_split_named(split_tree):
    assert doctor(split_tree, "--seconds", 1, "--workers", 1)["split"] == "train"
    assert doctor(split_tree, "--seconds", 1, "--workers", 1, "--split", "val")["split"] == "val"
