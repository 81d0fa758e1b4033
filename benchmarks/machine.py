"""Describes the machine a run measured: CPUs, memory, GPU, library versions, disk."""
from __future__ import annotations

import glob
import importlib
import os
import platform
import shutil
import sys
import warnings

from packer.cores import available_cores


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


BALLOON_DEVICE = "0x0005"  # virtio device id of a memory balloon
BALLOON_REPORTING = 5  # feature bit VIRTIO_BALLOON_F_REPORTING: free pages go back to the host


def _sysfs(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def memory_reclaim(root: str = "/sys") -> list[str]:
    """What on this machine takes memory back on its own: running DAMON schemes that page
    out or deprioritise idle memory, and a virtio balloon (that reports free pages to the
    host). Either can drop page-cache pages or hand the guest pages behind them back to the
    host between cases, which moves warm figures."""
    found = []
    for state in sorted(glob.glob(f"{root}/kernel/mm/damon/admin/kdamonds/*/state")):
        if _sysfs(state) != "on":
            continue
        for scheme in sorted(glob.glob(f"{os.path.dirname(state)}/contexts/*/schemes/*/")):
            action = _sysfs(f"{scheme}action")
            if action not in ("pageout", "lru_deprio"):
                continue
            context = os.path.dirname(os.path.dirname(os.path.dirname(scheme)))
            aggr_us = int(_sysfs(f"{context}/monitoring_attrs/intervals/aggr_us") or 0)
            age = int(_sysfs(f"{scheme}access_pattern/age/min") or 0)
            found.append(f"DAMON {action} of memory idle for {age * aggr_us / 1e6:g} s")
    for device in sorted(glob.glob(f"{root}/bus/virtio/devices/*")):
        if _sysfs(f"{device}/device") == BALLOON_DEVICE:
            features = _sysfs(f"{device}/features")
            reporting = len(features) > BALLOON_REPORTING and features[BALLOON_REPORTING] == "1"
            found.append("virtio balloon" + (" with free page reporting" if reporting else ""))
    return found


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
        "memory_reclaim": memory_reclaim(),
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


def packages() -> dict:
    """The versions of torch, packer's dependencies and the bench's tools (None: not importable)."""
    found = {}
    for name in ("torch", "torchvision", "numpy", "PIL", "lmdb", "h5py", "simplejpeg", "deflate", "webdataset",
                 "wids", "braceexpand", "pynvml", "matplotlib", "pytest", "click", "tqdm"):
        try:
            module = importlib.import_module(name)
            with warnings.catch_warnings():  # click deprecates __version__
                warnings.simplefilter("ignore")
                found[name] = getattr(module, "__version__", "present")
        except Exception as exc:  # ImportError, or a broken binary wheel
            found[name] = None if isinstance(exc, ImportError) else f"broken: {type(exc).__name__}: {exc}"
    return found


def cpu_topology() -> dict:
    """The CPU model and how many hardware threads share a core (2: SMT siblings halve a
    core's decode rate when both run)."""
    out = {}
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            siblings = f.read().strip()
        out["cpu0_thread_siblings"] = siblings
        out["threads_per_core"] = sum(len(range(int(a), int(b or a) + 1)) for a, _, b in
                                      (part.partition("-") for part in siblings.split(",")))
        out["cpu_model"] = cpu_model()
    except (OSError, ValueError):
        pass
    return out


def describe_cuda() -> dict:
    """torch, its CUDA build, the GPU and the CPUs: what a GPU run (benchmarks.gpu) records first."""
    import torch

    info = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
            **cpu_topology()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version())
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    return info
