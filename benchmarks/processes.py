"""A process's memory and wall time as the scale studies measure them: peak RSS and
anonymous memory of a command (timed_process), USS from /proc/PID/smaps_rollup (memory),
and a fresh process's open() of a pack (open_seconds)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

SAMPLE_S = 0.05
MB = 1 << 20


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of a live process, in bytes (empty once it is gone)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes: Rss, Pss, Private_Clean, Private_Dirty, Anonymous..."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                found[key] = int(parts[0]) * 1024
    return found


def memory(pid: int | str = "self") -> dict[str, float]:
    """RSS, USS (private: Private_Clean + Private_Dirty), Private_Dirty alone (memory no other
    process can share, mostly the heap) and anonymous memory, in MB. Private_Clean also
    counts page-cache pages of a mapped file that no other process maps at the moment."""
    m = smaps_rollup(pid)
    return {"rss_mb": m["Rss"] / MB, "uss_mb": (m["Private_Clean"] + m["Private_Dirty"]) / MB,
            "private_dirty_mb": m["Private_Dirty"] / MB, "anon_mb": m.get("Anonymous", 0) / MB}


def timed_process(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run cmd; its wall time, peak RSS (the kernel's, of the largest process: it and the
    children it waited for) and peak anonymous memory of the main process (sampled).
    Past timeout seconds it is stopped and "timed_out" is true."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    peak_anon = 0
    output = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()), daemon=True)
    reader.start()
    while True:
        found = proc_status(proc.pid)
        peak_anon = max(peak_anon, found.get("RssAnon", 0))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if timeout is not None and time.perf_counter() - start > timeout:
            proc.terminate()  # packer's own interrupt handling: it leaves nothing behind
            pid, status, usage = os.wait4(proc.pid, 0)
            reader.join()
            return {"wall_s": time.perf_counter() - start, "timed_out": True, "peak_rss_mb": usage.ru_maxrss / 1024,
                    "peak_anon_mb": peak_anon / MB, "output": ""}
        time.sleep(SAMPLE_S)
    wall = time.perf_counter() - start
    reader.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    text = output[0].decode(errors="replace") if output else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-2000:]}")
    return {"wall_s": wall, "timed_out": False, "peak_rss_mb": usage.ru_maxrss / 1024,
            "peak_anon_mb": peak_anon / MB, "output": text}


OPEN_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import packer
from packer import open_reader
t1 = time.perf_counter()
reader = open_reader(sys.argv[1], split="train")
reader.open()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1}))
"""


def open_seconds(out: str, runs: int = 3) -> dict:
    """A fresh process's open_reader + open() time (imports left out), median of runs."""
    times = []
    for _ in range(runs):
        result = timed_process([sys.executable, "-c", OPEN_PROBE, out])
        times.append(json.loads(result["output"].strip().splitlines()[-1])["open_s"])
    return {"open_s": float(np.median(times)), "open_s_runs": times}
