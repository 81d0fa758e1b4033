"""packer doctor: what each stage of a training read of one dataset costs on this machine, what
the machine offers, and which change would feed a GPU faster.

A training read goes: read the record (cold from disk the first epoch, or every epoch when
the data outgrows the page cache; warm from the cache after), check it (packed data), decode
it and crop it (RandomResizedCrop(224)). Each stage is timed alone on one core, over a
seeded sample of records, then the whole read at N worker processes; the slowest stage per
core is the limit. Every stage stops at its share of a time budget, so a run is bounded
whatever the dataset's size. Dropping the page cache (posix_fadvise, no root) also drops it
for anyone else reading those files at the moment.
"""
from __future__ import annotations

import io
import math
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import time

from PIL import Image

from .advice import GPU_DECODE_RATE, MAX_SIDE, max_side_gain
from .cores import available_cores
from .errors import FormatError
from .folder import FolderReader
from .formats import CAN_ADVISE, detect_format, evict, open_reader, read_metadata
from .load import busy_words, load_words, machine_load
from .scan import scan_source

SAMPLE = 4096  # records drawn at most: enough for steady rates, few enough to list fast
DECODE_KEEP = 256  # encoded images kept in memory for the decode stages
# Each stage's share of the time budget; the rest of a run is start-up (listing, imports).
BUDGET = {"cold_read": 0.15, "warm_read": 0.08, "checked_read": 0.08, "decode": 0.14, "decode_crop": 0.14,
          "workers": 0.25}
CROP = 224
# NVJPG engines per GPU model (NVIDIA's architecture whitepapers): nvidia-smi does not count them.
JPEG_ENGINES = {"H200": 7, "H100": 7, "GH200": 7, "A100": 1, "A30": 1, "L4": 4, "L40": 0, "A10": 0}


def examine(path: str, *, split: str | None = None, workers: int | None = None, batch_size: int = 256,
            target_rate: float | None = None, seconds: float = 20.0) -> dict:
    """Stages, limit, ceiling, findings and machine facts for the dataset or source folder at
    path, in about `seconds` (plus listing the folder)."""
    kind, reader = open_source(path, split)
    if len(reader) == 0:
        raise FormatError(f"{path}: split {reader.split!r} holds no images; nothing to measure", path)
    cores = available_cores()
    workers = workers or cores
    load_before = machine_load(cores)
    indexes = random.Random(0).sample(range(len(reader)), min(len(reader), SAMPLE))
    stages: dict = {}
    if CAN_ADVISE:
        stages["cold_read"] = cold_read(path, kind, reader, indexes, seconds * BUDGET["cold_read"])
    images: list = []
    warm = unchecked(reader, path, kind)
    stages["warm_read"] = timed_reads(warm, indexes, seconds * BUDGET["warm_read"], images)
    if warm is not reader:
        warm.close()  # the checked read maps the file afresh, as the unchecked one did
    if kind != "folder":
        stages["checked_read"] = timed_reads(reader, indexes, seconds * BUDGET["checked_read"], [])
    stages["decode"] = timed_each(decode_pil, images, seconds * BUDGET["decode"])
    via, crop = crop_decoder()
    stages["decode_crop"] = {**timed_each(crop, images, seconds * BUDGET["decode_crop"]), "via": via}
    read_stage = "checked_read" if kind != "folder" else "warm_read"
    at_workers = pipeline_rate(reader, indexes, workers, seconds * BUDGET["workers"])
    limit = min((name for name in ("cold_read", read_stage, "decode_crop") if name in stages),
                key=lambda name: stages[name]["samples_per_s"])
    report = {
        "path": path, "kind": kind, "split": reader.split, "records": len(reader), "workers": workers,
        "batch_size": batch_size, "stages": stages, "limit": limit,
        "ceiling_samples_per_s": at_workers,
        "image": image_facts(images), "machine": machine_facts(cores),
    }
    # The 1-minute average after the run holds the run's own workers too.
    report["load"] = {"before": load_before, "after": machine_load(cores, own=min(workers, cores))}
    report["untrusted"] = untrusted(report, read_stage)
    report["findings"] = findings(report, target_rate)
    return report


def untrusted(report: dict, read_stage: str) -> list:
    """Why the figures are not to be trusted: other work held the cores, or the whole read
    over every worker came out below what one core gave alone."""
    busy = busy_words({f"{when} the run": load for when, load in report["load"].items()})
    why = [busy] if busy else []
    stages = report["stages"]
    one_core = 1 / (1 / stages[read_stage]["samples_per_s"] + 1 / stages["decode_crop"]["samples_per_s"])
    if report["ceiling_samples_per_s"] < 0.9 * one_core:
        why.append(f"{report['workers']} workers read, decoded and cropped {report['ceiling_samples_per_s']:.0f} "
                   f"samples/s, below the {one_core:.0f} one core gave alone stage by stage: other work took the "
                   "cores meanwhile")
    return why


def open_source(path: str, split: str | None):
    """("folder", FolderReader) for a source folder, (format, Reader) for a packed dataset."""
    try:
        kind = detect_format(path)
    except FormatError:
        if not os.path.isdir(path):
            raise
        source = scan_source(path)  # once: a large folder takes a while to list
        return "folder", FolderReader(path, split or train_split(list(source.splits)), source)
    return kind, open_reader(path, split or train_split(list(read_metadata(path).splits)))


def train_split(splits: list) -> str | None:
    """"train" where the dataset holds several splits and one is called so; else None (the
    reader takes the only split, or says which to pass)."""
    return "train" if len(splits) > 1 and "train" in splits else None


def unchecked(reader, path: str, kind: str):
    """The same split read without record checksums: the warm read's own cost."""
    return reader if kind == "folder" else open_reader(path, reader.split, check_crc=False)


def cold_read(path: str, kind: str, reader, indexes: list, budget: float) -> dict:
    """Reads after the sampled files (a folder's) or the dataset's files were dropped from the
    page cache, through a reader opened afterwards (a mapping made before keeps its pages)."""
    if kind == "folder":
        files = [os.path.join(reader.path, reader.paths[i]) for i in indexes]
        fresh = reader
    else:
        files = dataset_files(path)
        reader.close()
        fresh = open_reader(path, reader.split, check_crc=False)
    evict(files)
    try:
        return timed_reads(fresh, indexes, budget, [])
    finally:
        if fresh is not reader:
            fresh.close()


def dataset_files(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]


def timed_reads(reader, indexes: list, budget: float, keep: list) -> dict:
    """Reads records in the sample's order until the budget is spent; keeps the first
    DECODE_KEEP images' bytes in keep."""
    count, nbytes, start = 0, 0, time.perf_counter()
    for i in indexes:
        data, _ = reader.read_image(i)
        count += 1
        nbytes += len(data)
        if len(keep) < DECODE_KEEP:
            keep.append(data)
        if time.perf_counter() - start > budget:
            break
    return rates(count, time.perf_counter() - start, mb_per_s=nbytes / 1e6)


def timed_each(fn, images: list, budget: float) -> dict:
    """fn over images, round and round, until the budget is spent (at least once each)."""
    count, start = 0, time.perf_counter()
    while images:
        for data in images:
            fn(data)
            count += 1
        if time.perf_counter() - start > budget:
            break
    return rates(count, time.perf_counter() - start)


def rates(count: int, elapsed: float, mb_per_s: float | None = None) -> dict:
    out = {"samples_per_s": count / elapsed if elapsed > 0 else 0.0,
           "ms_per_sample": 1e3 * elapsed / count if count else 0.0, "samples": count}
    if mb_per_s is not None and elapsed > 0:
        out["mb_per_s"] = mb_per_s / elapsed
    return out


def decode_pil(data: bytes):
    """RGB pixels, as torchvision's ImageFolder loader decodes."""
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def crop_decoder():
    """(how, decode + RandomResizedCrop(224)): readers' decode-aware path where torch is
    installed (packer itself installs without it), else Pillow's full decode and resize."""
    try:
        import torch
        from readers import RandomResizedCrop  # lazily: only this stage needs torch
    except ImportError:
        return "Pillow (torch not installed)", pil_crop
    torch.set_num_threads(1)  # as each DataLoader worker runs
    return "readers, decode='raw'", RandomResizedCrop(CROP)


def pil_crop(data: bytes, rng=random.Random(0)):
    image = decode_pil(data)
    w, h = image.size
    side = int(min(w, h) * math.sqrt(rng.uniform(0.08, 1.0)))
    left, top = rng.randint(0, w - side), rng.randint(0, h - side)
    return image.resize((CROP, CROP), Image.BILINEAR, box=(left, top, left + side, top + side))


def pipeline_rate(reader, indexes: list, workers: int, budget: float) -> float:
    """samples/s of the whole training read (checked read, decode, crop) in `workers`
    processes at once, each on its own share of the sample."""
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    shares = [(reader, indexes[k::workers], budget) for k in range(workers)]
    pool = context.Pool(workers, initializer=quiet_worker)
    try:
        return sum(pool.starmap(worker_rate, shares))
    finally:
        pool.close()  # not terminate(): its SIGTERM would reach packer's stop handler in each worker
        pool.join()


def quiet_worker() -> None:
    """Ctrl-C is the command's to handle (it stops the pool); a worker told to stop just ends,
    without the traceback packer's stop handler, inherited, would print."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def worker_rate(reader, indexes: list, budget: float) -> float:
    _, crop = crop_decoder()
    count, start = 0, time.perf_counter()
    for i in indexes:
        crop(reader.read_image(i)[0])
        count += 1
        if time.perf_counter() - start > budget:
            break
    elapsed = time.perf_counter() - start
    reader.close()
    return count / elapsed if elapsed > 0 else 0.0


def image_facts(images: list) -> dict:
    """Mean stored size of the images decoded (headers only)."""
    sides = []
    for data in images:
        try:
            with Image.open(io.BytesIO(data)) as im:
                sides.append(im.size)
        except Exception:  # the decode stages already read it; an odd one does not change the mean
            continue
    if not sides:
        return {}
    return {"mean_width": sum(w for w, _ in sides) / len(sides), "mean_height": sum(h for _, h in sides) / len(sides),
            "mean_long_side": sum(max(s) for s in sides) / len(sides)}


def machine_facts(cores: int) -> dict:
    """Usable cores, /dev/shm, pinning and the GPU, as far as this machine tells."""
    try:
        shm = shutil.disk_usage("/dev/shm").total
    except OSError:
        shm = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {"usable_cores": cores, "affinity_cores": affinity, "shm_bytes": shm, **gpu_facts()}


def gpu_facts() -> dict:
    """The GPU nvidia-smi names (bounded wait), its JPEG engines, and whether torch can pin memory."""
    facts: dict = {"gpu": None, "jpeg_engines": None, "can_pin": None}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        names = []
    if names:
        facts["gpu"] = names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
        facts["jpeg_engines"] = next((n for model, n in JPEG_ENGINES.items() if model in names[0]), None)
    try:
        import torch  # lazily: packer installs without torch
    except ImportError:
        return facts
    if torch.cuda.is_available():
        try:
            facts["can_pin"] = bool(torch.empty(1).pin_memory().is_pinned())
        except RuntimeError:
            facts["can_pin"] = False
    else:
        facts["can_pin"] = False
    return facts


def findings(report: dict, target_rate: float | None) -> list:
    """What would raise the ceiling, each with the rate it should give: the read path (pack
    it, or block order), workers, --max-side, gpu_decode."""
    stages, ceiling, workers = report["stages"], report["ceiling_samples_per_s"], report["workers"]
    cores = report["machine"]["usable_cores"]
    found = []
    cold = stages.get("cold_read")
    if cold and cold["samples_per_s"] < ceiling:
        found.append(cold_finding(report, cold, ceiling))
    if workers < cores:
        found.append(finding(
            "workers", f"num_workers={workers} reads, decodes and crops {ceiling:.0f} samples/s; {cores} cores are "
            "usable",
            f"num_workers={cores}: about {ceiling * cores / workers:.0f} samples/s"))
    if target_rate and ceiling < target_rate:
        per_worker = ceiling / workers
        needed = math.ceil(target_rate / per_worker) if per_worker > 0 else None
        if needed and needed <= cores and workers < needed:
            found = [f for f in found if f["setting"] != "workers"]
            found.append(finding("workers", f"num_workers={workers} makes {ceiling:.0f} samples/s, "
                                 f"{per_worker:.0f} each; the target is {target_rate:.0f}",
                                 f"num_workers={needed}: about {per_worker * needed:.0f} samples/s"))
        elif needed:
            found.append(finding("target_rate", f"{target_rate:.0f} samples/s needs {needed} workers at "
                                 f"{per_worker:.0f} samples/s each; {cores} cores are usable",
                                 "make a sample cheaper (a packed format, --max-side, gpu_decode), or use more "
                                 f"cores: at most {per_worker * cores:.0f} samples/s on these {cores}"))
    if report["limit"] == "decode_crop":
        found += decode_findings(report, ceiling)
    return found


def cold_finding(report: dict, cold: dict, ceiling: float) -> dict:
    reading = f"{cold['samples_per_s']:.0f} samples/s ({cold.get('mb_per_s', 0):.1f} MB/s) on one core"
    if report["kind"] == "folder":
        return finding(
            "format", f"cold reads of the folder's files run at {reading}, below the {ceiling:.0f} samples/s "
            f"that {report['workers']} workers decode and crop",
            f"pack it (packer pack SRC --to lmdb, then readers.LMDBDataset): one file read in large runs; up to "
            f"{ceiling:.0f} samples/s where reads keep up (warm reads here: "
            f"{report['stages']['warm_read']['samples_per_s']:.0f} samples/s a core)")
    return finding(
        "order", f"cold reads of the packed records run at {reading}, below the {ceiling:.0f} samples/s that "
        f"{report['workers']} workers decode and crop",
        f"make_loader(order='block') (pack with --shuffle-seed 0): near-sequential reads of shuffled blocks; up "
        f"to {ceiling:.0f} samples/s where reads keep up, or keep the dataset in the page cache (RAM)")


def decode_findings(report: dict, ceiling: float) -> list:
    found = []
    long_side = report["image"].get("mean_long_side", 0)
    gain = max_side_gain(long_side)
    if gain is not None:  # a crop's DCT scaling already saves some of it
        found.append(finding(
            "max_side", f"decode + crop is the slowest stage ({report['stages']['decode_crop']['ms_per_sample']:.2f}"
            f" ms a sample) and images have a {long_side:.0f} px long side on average",
            f"pack with --max-side {MAX_SIDE} (docs/resolution.md): about {gain:.1f}x fewer pixels to decode, up to "
            f"{ceiling * gain:.0f} samples/s where reads keep up"))
    gpu, engines = report["machine"]["gpu"], report["machine"]["jpeg_engines"]
    if gpu and ceiling < GPU_DECODE_RATE:
        found.append(finding(
            "gpu_decode", f"decode + crop is the slowest stage and {report['workers']} workers make "
            f"{ceiling:.0f} samples/s; this machine has a {gpu}"
            + (f" with {engines} JPEG engines" if engines else ""),
            f"make_loader(..., device='cuda', gpu_decode=True): {GPU_DECODE_RATE} samples/s decoded and cropped on "
            f"one H100 (docs/benchmarks.md)"))
    return found


def finding(setting: str, evidence: str, fix: str) -> dict:
    return {"setting": setting, "evidence": evidence, "fix": fix}


def render(report: dict) -> list:
    """The report as lines of text."""
    m = report["machine"]
    lines = [f"{report['path']}: {report['kind']}, split {report['split']!r}, {report['records']} records",
             f"machine: {m['usable_cores']} usable cores (affinity {m['affinity_cores']}), /dev/shm "
             + (f"{m['shm_bytes'] / 2**30:.1f} GiB" if m["shm_bytes"] else "absent")
             + f", GPU: {m['gpu'] or 'none'}"
             + (f" ({m['jpeg_engines']} JPEG engines)" if m["jpeg_engines"] is not None else "")
             + f", pinned memory: {PIN_WORDS[m['can_pin']]}",
             load_words(report["load"]["before"])]
    for why in report["untrusted"]:
        lines.append(f"figures not to be trusted: {why}")
    lines.append("stage (one core)       samples/s   ms/sample")
    for name, s in report["stages"].items():
        extra = f"  {s['mb_per_s']:.1f} MB/s" if "mb_per_s" in s else (f"  ({s['via']})" if "via" in s else "")
        mark = "  <- limit" if name == report["limit"] else ""
        lines.append(f"  {name:<20}{s['samples_per_s']:>11.0f}{s['ms_per_sample']:>12.2f}{extra}{mark}")
    lines.append(f"ceiling: {report['ceiling_samples_per_s']:.0f} samples/s at {report['workers']} workers "
                 f"({'read' if report['kind'] == 'folder' else 'checked read'}, decode, crop), "
                 f"{report['ceiling_samples_per_s'] / report['batch_size']:.1f} "
                 f"batches of {report['batch_size']} a second")
    for k, f in enumerate(report["findings"], 1):
        lines += [f"{k}. {f['setting']}: {f['evidence']}", f"   fix: {f['fix']}"]
    if not report["findings"] and report["untrusted"]:
        lines.append("no finding: none can be drawn from figures measured while other work held the cores")
    elif not report["findings"]:
        lines.append("no finding: every core decodes, and no change measured here would raise the ceiling")
    return lines


PIN_WORDS = {True: "yes", False: "no (no CUDA device)", None: "unknown (no torch)"}
