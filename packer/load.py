"""How busy the machine is with other work: the load average against the usable cores.

A rate measured while other processes hold the cores is theirs to share: on 2 cores at a
load of 3.4 a whole read over every core came out below one core's rate measured a moment
before. packer doctor and readers.diagnose report the load next to their figures and say
when it makes them untrustworthy, rather than let a busy machine pass for a slow read.
"""
from __future__ import annotations

import os
import time

# A 1-minute load above this share of the usable cores means other work took cores from
# the measurement (its own processes add to the load too, so a quiet machine stays under).
BUSY_SHARE = 0.5


def machine_load(cores: int, own: float = 0.0) -> dict:
    """The 1- and 5-minute load averages, the load of other work (less `own`, the runnable
    processes the caller knows are its own), and whether figures measured now are to be
    trusted. Load is None where the system does not report it."""
    try:
        one, five, _ = os.getloadavg()
    except (AttributeError, OSError):
        return {"load_1min": None, "load_5min": None, "cores": cores, "other_load": None, "trusted": True}
    other = max(0.0, one - own)
    return {"load_1min": one, "load_5min": five, "cores": cores, "other_load": other,
            "trusted": other <= BUSY_SHARE * cores}


def load_words(load: dict) -> str:
    """One line on the load: the averages, and busy or quiet."""
    if load["load_1min"] is None:
        return "load: unknown (no load average on this system)"
    verdict = "quiet enough to measure" if load["trusted"] else "busy: other work holds cores"
    return (f"load: {load['load_1min']:.1f} (1 min), {load['load_5min']:.1f} (5 min) on {load['cores']} usable "
            f"cores, {verdict}")


def busy_words(loads: dict) -> str | None:
    """Why figures measured under these loads ({when: machine_load()}) are not to be trusted, or None."""
    busy = {when: load for when, load in loads.items() if not load["trusted"]}
    if not busy:
        return None
    cores = next(iter(busy.values()))["cores"]
    at = ", ".join(f"{load['other_load']:.1f} {when}" for when, load in busy.items())
    return (f"other work held the cores (a load of {at}, over {BUSY_SHARE * cores:.1f} on {cores} cores): "
            "the rates are below what this machine gives; measure again when it is quiet")


class CpuWindow:
    """The cores a stretch of work had: what this process and its reaped children used, and
    what stayed idle on the machine (Linux /proc/stat), so a rate can be scaled to the cores
    that were actually free rather than to the cores the machine has."""

    def __init__(self):
        self.begun = (time.perf_counter(), os.times(), idle_and_total())

    def cores(self) -> dict:
        """Cores' worth used since the window began: "main" by this process, "workers" by its
        children that have exited (been reaped) since, "ours" both; "idle" left idle on the
        machine (None where /proc/stat is not there)."""
        wall0, times0, stat0 = self.begun
        wall = max(time.perf_counter() - wall0, 1e-9)
        times = os.times()
        main = (times.user + times.system - times0.user - times0.system) / wall
        workers = (times.children_user + times.children_system - times0.children_user - times0.children_system) / wall
        stat = idle_and_total()
        idle = None
        if stat0 is not None and stat is not None and stat[1] > stat0[1]:
            idle = (stat[0] - stat0[0]) / (stat[1] - stat0[1]) * (os.cpu_count() or 1)
        return {"ours": main + workers, "main": main, "workers": workers, "idle": idle}


def idle_and_total() -> tuple[int, int] | None:
    """(idle + iowait, all) jiffies of every CPU since boot, or None without /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])
