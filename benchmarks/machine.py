"""Describes the machine a run measured: CPUs, memory, GPU, library versions, disk."""
from __future__ import annotations

import os
import platform
import shutil
import sys

from packer.pack import available_cores


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def mount_of(path: str) -> dict:
    """Device, filesystem type and rotational flag of the mount holding path (Linux)."""
    path = os.path.realpath(path)
    best = {"mount": "", "device": "", "fstype": ""}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best["mount"]):
                    best = {"mount": mount, "device": device, "fstype": fstype}
    except OSError:
        return best
    name = os.path.basename(best["device"])
    for candidate in (name, name.rstrip("0123456789"), name.rsplit("p", 1)[0]):
        flag = f"/sys/block/{candidate}/queue/rotational"
        if candidate and os.path.exists(flag):
            with open(flag) as f:
                best["rotational"] = f.read().strip() == "1"
            break
    return best


def describe(data_dir: str) -> dict:
    """The facts that make two runs comparable, in one JSON-ready dict."""
    import numpy

    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": available_cores(),
        "ram_bytes": ram_bytes(),
        "numpy": numpy.__version__,
        "disk": {**mount_of(data_dir), "free_bytes": shutil.disk_usage(data_dir).free},
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    for module in ("torch", "lmdb", "h5py", "webdataset", "simplejpeg", "PIL"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # absent or broken: recorded, not fatal
            info[module] = None
    try:
        import torch

        info["cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        info["gpu"] = torch.cuda.get_device_name(0) if info["cuda_available"] else None
    except Exception:
        info.update(cuda=None, cuda_available=False, gpu=None)
    return info
