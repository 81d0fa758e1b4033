"""diagnose(): runs a training loop's own loader (and step) and names, from what it measured,
the setting that keeps the GPU waiting.

It times every next() against every step (readers.stats' split of wall time), the start of
each epoch, the threads each DataLoader worker keeps busy (from /proc), and, for a map-style
Dataset, what one sample costs inside a worker: stage by stage (read, check, decode, transform)
for packer's Datasets, then collate and the hand-over of a batch to the main process. A
setting is named only when those figures say it holds the loop back, and each finding
gives the numbers, what to set and the rate that setting should give. When the step is the
limit, nothing asks for more data throughput.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time

import torch

from packer.cores import available_cores
from packer.advice import GPU_DECODE_RATE, MAX_SIDE, max_side_gain

from ._dataset import ReaderDataset
from ._looptimes import RAW_CROP_STAGE, STALL_SECONDS, loader_settings, probe_samples, run_loop, worker_stages
from .decode import image_size
from .folder import FolderDataset

WAIT_LIMIT = 0.1  # the loop waits for data more than this fraction of its time: data is the limit
START_SHARE = 0.05  # worker start-up costing more than this share of the time is worth naming
HEADROOM = 1.15  # workers asked for: the mean need plus this margin for uneven samples


@dataclasses.dataclass
class Finding:
    """One setting that holds the loop back: what was measured, and what to set."""

    setting: str
    evidence: str
    fix: str
    share: float = 0.0  # the part of the measured wall time it explains; orders the findings

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Diagnosis:
    """What limits the loop ("data" or "step"), how much of its time it waited, and why."""

    limit: str
    wait_fraction: float
    findings: list
    figures: dict

    def to_dict(self) -> dict:
        return {"limit": self.limit, "wait_fraction": self.wait_fraction,
                "findings": [f.to_dict() for f in self.findings], "figures": self.figures}

    def __str__(self) -> str:
        f = self.figures
        lines = [f"limit: {self.limit} (the loop waited for data {self.wait_fraction:.0%} of the time after its "
                 f"workers first started; {f['samples_per_s']:.0f} samples/s over {f['steps']} steps, "
                 f"{f['epochs']} epochs, {f['wall_s']:.2f} s)",
                 f"loader: num_workers={f['workers']}, persistent_workers={f['persistent_workers']}, "
                 f"prefetch_factor={f['prefetch_factor']}, pin_memory={f['pin_memory']}, "
                 f"batch_size={f['batch_size']}; {f['cores']} usable cores",
                 f"per batch: step {f['step_ms']:.1f} ms, wait {f['wait_ms']:.1f} ms (steady), "
                 f"epoch start {f['start_ms']:.0f} ms"]
        if f["stages_ms"]:
            stages = ", ".join(f"{name} {ms:.2f}" for name, ms in worker_stages(f["stages_ms"]).items())
            lines.append(f"inside a worker, ms a sample: {stages}; a batch: {f['batch_cost_ms']:.1f} ms; "
                         f"{f['cores']} cores at that cost: {f['ceiling_samples_per_s']:.0f} samples/s")
            if RAW_CROP_STAGE in f["stages_ms"]:
                lines.append(f"  decode='raw' + readers.RandomResizedCrop(224) on the same images: "
                             f"{f['stages_ms'][RAW_CROP_STAGE]:.2f} ms a sample")
        if not self.findings:
            lines.append("no setting to change: " + ("the step is the limit" if self.limit == "step" else
                                                     "the data is the limit, and the workers are all busy"))
        for k, finding in enumerate(self.findings, 1):
            lines += [f"{k}. {finding.setting}: {finding.evidence}", f"   fix: {finding.fix}"]
        return "\n".join(lines)


def diagnose(loader, step=None, *, steps: int = 50, epochs: int = 2, timeout: float = STALL_SECONDS) -> Diagnosis:
    """Run up to `steps` batches of `loader` for `epochs` epochs, calling step(batch) on each,
    and say what holds the loop back.

    Args:
        loader: any iterable of batches (a torch DataLoader, make_loader's, a WebLoader).
        step: the training step, timed with CUDA synchronised where CUDA is in use; None
            measures the data alone (then the data is always the limit).
        timeout: seconds any one wait may take (the samples timed in this process, one
            batch); past it, TimeoutError names the sample or batch that stalled.
    """
    if steps < 2 or epochs < 1:
        raise ValueError(f"diagnose: steps must be >= 2 and epochs >= 1, got {steps} and {epochs}")
    if not timeout > 0:
        raise ValueError(f"diagnose: timeout must be a number of seconds > 0, got {timeout!r}")
    settings = loader_settings(loader)
    stages = probe_samples(loader, settings, timeout)
    run = run_loop(loader, step, steps, epochs, timeout)
    return judge(settings, stages, run, timed_step=step is not None)


def judge(settings: dict, stages: dict, run: list, *, timed_step: bool) -> Diagnosis:
    """The findings the measurements support, most important first."""
    waits = [w for e in run for w in e["waits"]]
    step_times = [s for e in run for s in e["steps"]]
    wall = sum(waits) + sum(step_times)
    # Each worker's first batch of an epoch comes after its start: the start, not the
    # steady state (short of batches, all but the first are taken as steady).
    starting = min(max(1, settings["workers"]), min(len(e["waits"]) for e in run) - 1) or 1
    steady_waits = [w for e in run for w in e["waits"][starting:]]
    steady_steps = [s for e in run for s in e["steps"][starting:]] or step_times
    samples = [n for e in run for n in e["samples"]]
    batch = sorted(samples)[len(samples) // 2]
    step_s = median(steady_steps)
    workers, cores = settings["workers"], available_cores()
    # The run's start (workers starting, caches filling) is paid once a training run, so it
    # does not decide the limit; later epochs' starts recur and do.
    first = sum(run[0]["waits"][:starting])
    counted = wall - first
    wait_fraction = (sum(waits) - first) / counted if counted > 0 else 0.0
    limit = "data" if wait_fraction > WAIT_LIMIT else "step"
    cost = batch_cost(workers, stages, batch, steady_waits, steady_steps)
    m = Measured(settings, stages, run, wall, batch, step_s if timed_step else None, cost, cores,
                 steady_share(steady_waits, steady_steps), sum(samples) / wall if wall > 0 else 0.0)
    findings = pin_findings(settings, run[0]["first_batch"], m)
    if limit == "data":
        findings += restart_findings(m) + steady_findings(m, steady_waits) + thread_findings(m)
    findings.sort(key=lambda f: -f.share)
    figures = {
        "wall_s": wall, "steps": len(waits), "epochs": len(run), "samples_per_s": m.rate,
        "step_ms": 1e3 * step_s, "wait_ms": 1e3 * (sum(steady_waits) / len(steady_waits) if steady_waits else 0.0),
        "start_ms": 1e3 * sum(e["waits"][0] for e in run if e["waits"]) / len(run),
        "batch_cost_ms": 1e3 * cost if cost else None, "stages_ms": stages, "cores": cores,
        # What every usable core making batches could deliver at the cost measured.
        "ceiling_samples_per_s": cores * batch / cost if cost else None,
        "busy_threads_per_worker": max_busy(run),
        **{k: v for k, v in settings.items() if k not in ("dataset", "collate_fn")},
    }
    return Diagnosis(limit, wait_fraction, findings, figures)


@dataclasses.dataclass
class Measured:
    settings: dict
    stages: dict
    run: list
    wall: float
    batch: int
    target: float | None  # the step's time: the rate data must reach; None without a step
    cost: float | None  # seconds one worker takes to make one batch
    cores: int
    steady_share: float  # the part of the steady state (epochs' starts left out) spent waiting
    rate: float


def steady_share(waits: list, steps: list) -> float:
    total = sum(waits) + sum(steps)
    return sum(waits) / total if total > 0 else 0.0


def median(values: list) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def max_busy(run: list) -> int:
    return max((n for e in run for n in e["busy_threads"].values()), default=0)


def batch_cost(workers: int, stages: dict, batch: int, steady_waits: list, steady_steps: list) -> float | None:
    """Seconds one worker takes to make one batch: with no workers the wait itself; else the
    samples timed here, or, for an iterable Dataset, the workers' share of the period when
    they cannot keep up."""
    if workers == 0 and steady_waits:
        return sum(steady_waits) / len(steady_waits)
    if stages:
        return batch * sum(worker_stages(stages).values()) / 1e3
    if steady_waits:
        period = (sum(steady_waits) + sum(steady_steps)) / len(steady_waits)
        return workers * period
    return None


def restart_findings(m: Measured) -> list:
    s = m.settings
    if not s["workers"] or s["persistent_workers"] or len(m.run) < 2:
        return []
    firsts = [e["waits"][0] for e in m.run if e["waits"]]
    restart = sum(firsts) / len(firsts) - (m.cost or 0.0)
    saved = restart * (len(firsts) - 1)
    if restart < 0.05 or saved / m.wall < START_SHARE:
        return []
    samples = sum(n for e in m.run for n in e["samples"])
    return [Finding(
        "persistent_workers",
        f"each epoch's first batch waited {sum(firsts) / len(firsts):.2f} s, while a worker makes a batch in "
        f"{(m.cost or 0) * 1e3:.0f} ms: starting {s['workers']} workers again costs {restart:.2f} s an epoch, "
        f"{saved / m.wall:.0%} of the time measured",
        f"persistent_workers=True (workers start once, not every epoch): about "
        f"{samples / (m.wall - saved):.0f} samples/s over these epochs, now {m.rate:.0f}",
        saved / m.wall)]


def steady_findings(m: Measured, steady_waits: list) -> list:
    """Waits after each epoch's first batch: too few workers, a queue that drains, or samples
    too costly for the cores there are."""
    s = m.settings
    if m.steady_share <= WAIT_LIMIT or not m.cost:
        return []
    workers = s["workers"]
    needed = math.ceil(HEADROOM * m.cost / m.target) if m.target else m.cores
    wait_ms = 1e3 * sum(steady_waits) / (len(steady_waits) or 1)
    if workers < min(needed, m.cores):
        n = min(needed, m.cores)
        rate = min(n / m.cost, 1 / m.target if m.target else math.inf) * m.batch
        made_by = "the main process makes each batch between steps" if workers == 0 else f"{workers} workers"
        step = f"a {m.target * 1e3:.1f} ms step" if m.target else "no step timed"
        return [Finding(
            "num_workers",
            f"a batch costs {m.cost * 1e3:.1f} ms to make ({m.cost / m.batch * 1e3:.2f} ms a sample) and "
            f"{made_by}, against {step}: the loop waited {wait_ms:.1f} ms a batch",
            f"num_workers={n} ({m.cores} usable cores): about {rate:.0f} samples/s, now {m.rate:.0f}"
            + (f"; the step's {m.batch / m.target:.0f} samples/s needs {needed} workers' worth of cores"
               if m.target and needed > m.cores else ""),
            m.steady_share)]
    if workers and m.target and workers * m.target >= m.cost:
        # A drained queue shows as waits longer than a step, again and again; shorter or
        # lone ones are the scheduler's.
        drained = sum(1 for w in steady_waits if w > m.target) >= 2
        return [drain_finding(m, steady_waits, wait_ms)] if drained else []
    if m.target:
        return cost_findings(m, wait_ms)
    return []


def drain_finding(m: Measured, steady_waits: list, wait_ms: float) -> Finding:
    s = m.settings
    depth = s["workers"] * s["prefetch_factor"]
    longest = max(steady_waits)
    factor = math.ceil((depth + math.ceil(longest / m.target)) / s["workers"])
    return Finding(
        "prefetch_factor",
        f"{s['workers']} workers make {s['workers'] / m.cost * m.batch:.0f} samples/s on average, enough for the "
        f"step, yet the loop waited {wait_ms:.1f} ms a batch, up to {longest * 1e3:.0f} ms at once: slow batches "
        f"drain the queue of {depth} batches (num_workers x prefetch_factor {s['prefetch_factor']})",
        f"prefetch_factor={factor} (a queue of {factor * s['workers']} batches covers the longest wait): about "
        f"{m.batch / m.target:.0f} samples/s, now {m.rate:.0f}",
        m.steady_share)


def cost_findings(m: Measured, wait_ms: float) -> list:
    """Every core already works: what a sample costs must come down. Named only where a
    cheaper way was measured here, or the images are larger than a crop needs."""
    per_sample_ms = 1e3 * m.cost / m.batch
    stage, ms = max(worker_stages(m.stages).items(), key=lambda kv: kv[1]) if m.stages else ("getitem", per_sample_ms)
    evidence = (f"a sample costs {per_sample_ms:.2f} ms in a worker ({stage}: {ms:.2f} ms of it) and "
                f"{m.settings['workers']} workers on {m.cores} cores make at most "
                f"{1e3 * m.cores / per_sample_ms:.0f} samples/s; the loop waited {wait_ms:.1f} ms a batch")
    need = (f"the step's {m.batch / m.target:.0f} samples/s needs a sample to cost at most "
            f"{1e3 * m.target * m.cores / (HEADROOM * m.batch):.2f} ms on {m.cores} cores; now {m.rate:.0f} samples/s")

    def rate_without(saved_ms: float) -> str:
        return f"about {min(1e3 * m.cores / max(per_sample_ms - saved_ms, 1e-3), m.batch / m.target):.0f} samples/s"

    dataset = m.settings["dataset"]
    if not isinstance(dataset, ReaderDataset):
        return [Finding("format", evidence, "run `packer doctor` on the images to measure packer's read and "
                        f"decode path (readers' Datasets, decode='raw'); {need}", m.steady_share)]
    if stage == "read":
        folder = isinstance(dataset, FolderDataset)
        fix = ("pack the folder (packer pack SRC --to lmdb) and read it with readers.LMDBDataset" if folder else
               "make_loader(order='block'): near-sequential reads of shuffled blocks")
        return [Finding("format" if folder else "order", evidence, f"{fix}: {rate_without(ms)} where reads keep "
                        f"up; {need}", m.steady_share)]
    if stage not in ("decode", "transform"):
        return []
    decoding = m.stages.get("decode", 0.0) + m.stages.get("transform", 0.0)
    if dataset.decode != "raw":
        raw_ms = m.stages.get(RAW_CROP_STAGE)
        if raw_ms is not None and raw_ms < 0.8 * decoding:
            return [Finding("decode", evidence, f"decode='raw' with readers.RandomResizedCrop(224) (measured here: "
                            f"{raw_ms:.2f} ms a sample where decode + transform take {decoding:.2f}): "
                            f"{rate_without(decoding - raw_ms)}; {need}", m.steady_share)]
        return []
    long_side = mean_long_side(dataset)
    gain = max_side_gain(long_side)
    if gain is not None:
        return [Finding("max_side", evidence, f"pack with --max-side {MAX_SIDE} (images here have a {long_side:.0f} "
                        f"px long side on average): about {gain:.1f}x fewer pixels to decode, "
                        f"{rate_without(decoding * (1 - 1 / gain))}; {need}", m.steady_share)]
    if torch.cuda.is_available():
        return [Finding("gpu_decode", evidence, f"make_loader(..., device='cuda', gpu_decode=True): decode on the "
                        f"GPU ({GPU_DECODE_RATE} samples/s decoded and cropped on one H100, docs/benchmarks.md); "
                        f"{need}", m.steady_share)]
    return []


def probe_indexes(dataset, count: int = 32) -> list:
    return random.Random(1).sample(range(len(dataset)), min(count, len(dataset)))


def mean_long_side(dataset) -> float:
    """The stored images' mean long side, from their headers."""
    sides = [max(image_size(dataset.reader.read_image(i)[0])) for i in probe_indexes(dataset)]
    return sum(sides) / len(sides) if sides else 0.0


def thread_findings(m: Measured) -> list:
    workers, busy = m.settings["workers"], max_busy(m.run)
    if workers == 0 or busy <= 1 or workers * busy <= m.cores:
        return []
    return [Finding(
        "threads",
        f"each of {workers} workers kept up to {busy} threads busy (from /proc): {workers * busy} threads "
        f"on {m.cores} usable cores, so they take turns and evict each other's caches",
        "torch.set_num_threads(1) in worker_init_fn (and OMP_NUM_THREADS=1, cv2.setNumThreads(1) where OpenCV "
        f"decodes): one busy thread a worker, {min(workers, m.cores)} on {m.cores} cores; now {m.rate:.0f} samples/s",
        m.steady_share)]


def pin_findings(settings: dict, batch, m: Measured) -> list:
    """Pinning without a GPU to copy to, or copies to a GPU from pageable memory."""
    if not torch.cuda.is_available():
        if not settings["pin_memory"]:
            return []
        return [Finding("pin_memory", "pin_memory=True, but torch finds no CUDA device: nothing is copied to a "
                                      "GPU, so pinning buys nothing", "pin_memory=False", 0.0)]
    tensors = [t for t in leaves(batch) if t.device.type == "cpu" and not t.is_pinned()]
    if settings["pin_memory"] or not tensors:
        return []
    pageable, pinned = copy_seconds(tensors), copy_seconds([t.pin_memory() for t in tensors])
    if pageable < 1.3 * pinned or pageable - pinned < 5e-4:
        return []
    saved = (pageable - pinned) * sum(len(e["waits"]) for e in m.run)
    return [Finding(
        "pin_memory",
        f"batches arrive in pageable memory: copying one to the GPU took {pageable * 1e3:.1f} ms, "
        f"{pinned * 1e3:.1f} ms from pinned memory",
        f"pin_memory=True (and .to('cuda', non_blocking=True)): about "
        f"{m.rate * m.wall / max(m.wall - saved, 1e-9):.0f} samples/s, now {m.rate:.0f}",
        min(1.0, saved / m.wall))]


def leaves(batch) -> list:
    """The tensors in a batch of tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in leaves(item)]
    return []


def copy_seconds(tensors: list) -> float:
    """Seconds to copy tensors to the GPU, the best of three."""
    best = math.inf
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for x in tensors:
            x.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best
