"""How many cores this process may really use: its CPU affinity, capped by a CPU quota.

A container limited with `docker --cpus 4` or a Kubernetes CPU limit on a 64-core node
still sees 64 cores in its affinity mask; the limit is a CFS quota in its cgroup
(cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`). Starting a worker per
visible core there runs 16x more processes than the quota lets run, each throttled. The
quota of every cgroup from this process's own up to the root applies, so the smallest wins.
"""
from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def available_cores(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """The cores this process may run on (CPU affinity), capped by its cgroup CPU quota; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota(root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> float | None:
    """CPUs' worth of time this process's cgroups allow (e.g. 2.5), or None when unlimited or unknown."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: one unified hierarchy
            quotas += [_v2_quota(folder) for folder in _ancestors(root, path)]
        elif "cpu" in controllers.split(","):
            mount = os.path.join(root, controllers)
            if not os.path.isdir(mount):
                mount = os.path.join(root, "cpu")
            quotas += [_v1_quota(folder) for folder in _ancestors(mount, path)]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _ancestors(mount: str, path: str) -> list[str]:
    """mount/path and each of its parents up to mount itself."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [os.path.join(mount, *parts[:k]) for k in range(len(parts), -1, -1)]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_quota(folder: str) -> float | None:
    text = _read(os.path.join(folder, "cpu.max"))  # "max 100000" or "200000 100000"
    if not text:
        return None
    fields = text.split()
    try:
        return None if fields[0] == "max" else int(fields[0]) / int(fields[1])
    except (IndexError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: str) -> float | None:
    quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(os.path.join(folder, "cpu.cfs_period_us"))
    try:
        quota_us, period_us = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
