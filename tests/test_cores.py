"""packer.cores: affinity capped by a CPU quota, read from real (fake-rooted) cgroup trees."""
from __future__ import annotations

import os

from packer.cores import available_cores, cpu_quota


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def affinity() -> int:
    return len(os.sched_getaffinity(0))


def test_no_quota_is_the_affinity(tmp_path):
    proc = write(tmp_path / "cgroup", "0::/\n")
    write(tmp_path / "fs" / "cpu.max", "max 100000\n")
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) is None
    assert available_cores(str(tmp_path / "fs"), str(proc)) == affinity()


def test_cgroup_v2_quota_caps_the_cores_and_the_smallest_ancestor_wins(tmp_path):
    proc = write(tmp_path / "cgroup", "0::/kubepods/pod1/ctr\n")
    fs = tmp_path / "fs"
    write(fs / "kubepods" / "cpu.max", "150000 100000\n")            # 1.5 CPUs for the pods
    write(fs / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    assert cpu_quota(str(fs), str(proc)) == 1.5
    assert available_cores(str(fs), str(proc)) == min(affinity(), 2)  # 1.5 CPUs: 2 busy cores at most
    write(fs / "kubepods" / "pod1" / "cpu.max", "50000 100000\n")
    assert available_cores(str(fs), str(proc)) == 1


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = write(tmp_path / "cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    folder = tmp_path / "fs" / "cpu,cpuacct" / "docker" / "abc"
    write(folder / "cpu.cfs_quota_us", "100000\n")
    write(folder / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) == 1.0
    assert available_cores(str(tmp_path / "fs"), str(proc)) == 1
    write(folder / "cpu.cfs_quota_us", "-1\n")  # unlimited
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) is None


def test_unreadable_or_garbled_files_mean_no_quota(tmp_path):
    proc = write(tmp_path / "cgroup", "0::/../../etc\n")
    write(tmp_path / "fs" / "cpu.max", "lots\n")
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) is None
    assert cpu_quota(str(tmp_path / "fs"), str(tmp_path / "missing")) is None
    assert available_cores(str(tmp_path / "fs"), str(tmp_path / "missing")) == affinity()
