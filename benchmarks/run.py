"""Runs the suite: corpus, packing, every case in fresh processes, then results.json and a table.

The orchestrator itself only lists, packs and spawns; all reading is timed in child
processes (benchmarks.case), one per case by default.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import numpy as np

from packer.cores import available_cores

from . import cache, machine, report
from .measures import CEILING, DISK, MAP_ONLY, MEASURES, BareRead, MemoryCopy, Options
from .names import CACHE_STATES, PACKER_SOURCES
from .packtime import pack_options, time_pack, time_tar, tree_bytes
from .sources import SOURCES

SCHEMA = 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def corpus_shape(n: int) -> tuple[int, int]:
    """(classes, images per class) for about n images: ImageNet-like, many images per class."""
    classes = min(100, max(2, n // 100))
    return classes, math.ceil(n / classes)


def generate(folder: str, n: int, seed: int, workers: int) -> None:
    from packer.synth import make_corpus

    classes, per_class = corpus_shape(n)
    log(f"generating {classes * per_class} synthetic JPEGs ({classes} classes) in {folder}")
    make_corpus(folder, classes=classes, per_class=per_class, seed=seed, workers=workers)


class WorkdirError(Exception):
    """The workdir holds something the suite did not make where it would write."""


def reuse_corpus(folder: str, n: int, seed: int) -> None:
    """Generate the corpus into folder unless a --keep'd workdir already holds this exact one.

    The stamp beside the folder (corpus.json) is the suite's mark: written before a
    corpus is generated and completed after, so the suite replaces only a corpus it made
    (an interrupted one too). A folder without a stamp is someone else's: refused, never
    deleted."""
    stamp = folder + ".json"
    want = {"images": n, "seed": seed, "shape": corpus_shape(n)}
    if os.path.lexists(folder):
        made = read_stamp(stamp)
        if made is None:
            raise WorkdirError(f"{folder} exists and was not made by the benchmark suite (no {stamp} beside it); "
                               "it is left as it is: pass another --workdir, or move the folder away")
        if made == {**json.loads(json.dumps(want)), "complete": True}:
            log(f"reusing the corpus in {folder}")
            return
        log(f"replacing the corpus in {folder}: it was made for {made}")
        shutil.rmtree(folder)
    write_stamp(stamp, {**want, "complete": False})
    generate(folder, n, seed, max(1, available_cores()))
    write_stamp(stamp, {**want, "complete": True})


def read_stamp(stamp: str) -> dict | None:
    """The suite's stamp of a corpus, or None where there is none of its shape. A stamp
    written before "complete" existed was written only after its corpus was whole."""
    try:
        with open(stamp) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or not {"images", "seed", "shape"} <= found.keys():
        return None
    return {"complete": True, **found}


def write_stamp(stamp: str, facts: dict) -> None:
    with open(stamp + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(stamp + ".tmp", stamp)


def run_children(groups: list[list[dict]], ctx: dict, opts: Options, workdir: str) -> list[dict]:
    """Run each group of cases in one fresh process; a crashed process fails only its cases."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    results = []
    for i, cases in enumerate(groups):
        spec, out = os.path.join(workdir, f"case-{i}.json"), os.path.join(workdir, f"case-{i}.out.json")
        with open(spec, "w") as f:
            json.dump({"cases": cases, "ctx": ctx, "opts": asdict(opts), "interleave": interleaved(cases)}, f)
        limit = 120 + len(cases) * 4 * (opts.warmup + opts.repeat * (opts.budget + 30))
        try:
            # Child stdout goes to our stderr: stdout carries only the table.
            proc = subprocess.run([sys.executable, "-m", "benchmarks.case", spec, out], cwd=ROOT, env=env,
                                  stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=limit)
            failure = None if proc.returncode == 0 else f"case process exited {proc.returncode}: " \
                                                         f"{proc.stderr.strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            failure = f"case process ran past {limit:.0f} s and was stopped"
        if failure is None:
            with open(out) as f:
                done = json.load(f)
        else:
            done = [{**c, "status": "error", "error": failure} for c in cases]
        for r in done:
            log(report.progress_line(r))
        results += done
    return results


def pack_formats(formats: list[str], folder: str, workdir: str, workers: int, repeat: int,
                 loader_workers: int, state: str = "cold") -> tuple[dict, dict]:
    """({format: packed path}, {format or "tar": timing}) for every packed format asked for."""
    import packer.formats

    packed, timings = {}, {}
    corpus_bytes = tree_bytes(folder)
    for fmt in (f for f in formats if f != "folder"):
        if fmt not in packer.formats.FORMATS:
            timings[fmt] = {"status": "n/a", "reason": f"format {fmt!r} not in packer.formats.FORMATS"}
            continue
        out = os.path.join(workdir, "packed" + packer.formats.FORMATS[fmt].extension)
        log(f"packing {fmt} ({repeat}x) ...")
        try:
            timings[fmt] = time_pack(folder, fmt, out, workers, repeat,
                                     pack_options(fmt, corpus_bytes, loader_workers), state)
            packed[fmt] = out
        except Exception as exc:  # a broken writer is a result, not a crash
            timings[fmt] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        log(report.pack_line(fmt, timings[fmt]))
    try:
        timings["tar"] = time_tar(folder, os.path.join(workdir, "corpus.tar"), repeat, state)
    except (OSError, subprocess.CalledProcessError) as exc:
        timings["tar"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    log(report.pack_line("tar", timings["tar"]))
    return packed, timings


def takes(source, measure: str) -> bool:
    """Whether source has a row for measure: block order and the plain DataLoader need a
    map-style source, checked reads a packed one (its records carry a checksum)."""
    if measure in MAP_ONLY:
        return getattr(source, "blocks", False)
    return {"checked": getattr(source, "checks", False)}.get(measure, True)


def plan(args, ctx: dict, sources: dict) -> list[list[dict]]:
    """The cases to run, grouped by process; fills sources with each row's availability."""
    groups = []
    for name, source in SOURCES.items():
        fmt = getattr(source, "fmt", None) if not source.peer else None
        if name in PACKER_SOURCES and name not in args.formats or fmt and fmt not in args.formats \
                or source.peer and args.no_peers:
            continue
        reason = source.missing(ctx)
        sources[name] = {"peer": source.peer, "available": reason is None, "reason": reason, "measures": {}}
        if reason is not None:
            log(f"{name}: n/a ({reason})")
            continue
        cases = [{"source": name, "measure": m, "cache": s} for m in args.measures for s in args.cache
                 if takes(source, m)]
        groups += [[c] for c in cases] if args.isolation == "case" else [cases]
    if args.isolation == "case":
        groups = join_cells(cell_major(groups, args.measures, args.cache))
    ceiling = {"source": None, "measure": "ceiling", "cache": None}
    if args.isolation != "case" and groups:
        groups[0].insert(0, ceiling)  # one process start fewer
    else:
        groups.insert(0, [ceiling])
    if ctx["packed"] and "cold" in args.cache and ("block" in args.measures or "loader" in args.measures):
        groups.insert(1, [{"source": None, "measure": "disk", "cache": None}])
    return [sum(groups, [])] if args.isolation == "run" else groups


def cell_major(groups: list[list[dict]], measures: list[str], states: list[str]) -> list[list[dict]]:
    """One-case groups reordered so every source's case of one (measure, cache state) cell runs
    back to back: rows are compared within a cell, and on a machine whose speed drifts over
    minutes (this one's memory does), cases of one cell run half an hour apart measured the
    drift as much as the rows."""
    def cell(group: list[dict]) -> tuple[int, int]:
        case = group[0]
        return measures.index(case["measure"]), states.index(case["cache"])

    return sorted(groups, key=cell)  # stable: sources keep their order within a cell


# Measures whose cells run as one process, the sources interleaved round by round (case.run_cell).
# Their timed runs fork their own loader workers, so sharing the parent process shares little.
# e2e: its rows differ by a few percent, less than the machine drifts between cases run apart;
# loader: cold, it is read at the disk's rate, and this machine's disk drifted by a third
# between cases minutes apart.
INTERLEAVED = ("loader", "e2e")


def interleaved(cases: list[dict]) -> bool:
    """Whether a group is one cell of an INTERLEAVED measure (one measure and cache state)."""
    return len(cases) > 1 and len({(c["measure"], c["cache"]) for c in cases}) == 1 \
        and cases[0]["measure"] in INTERLEAVED


def join_cells(groups: list[list[dict]]) -> list[list[dict]]:
    """Cell-major one-case groups with each INTERLEAVED cell's cases joined into one group."""
    joined: list[list[dict]] = []
    for group in groups:
        case, last = group[0], joined[-1][0] if joined else None
        if case["measure"] in INTERLEAVED and last is not None and \
                (last["measure"], last["cache"]) == (case["measure"], case["cache"]):
            joined[-1] = joined[-1] + group
        else:
            joined.append(list(group))
    return joined


def mixing(ctx: dict, batch_size: int, seed: int) -> dict | None:
    """Class entropy per batch (bits) of each read order, on the packed data's storage order."""
    import readers
    from readers.sampler import BLOCK_SIZE, WINDOW

    for fmt in ("lmdb", "hdf5"):
        if fmt in ctx["packed"]:
            dataset = readers.open_dataset(ctx["packed"][fmt], decode="raw")
            break
    else:
        return None
    try:
        labels = dataset.targets
        if len(labels) < batch_size:
            return None
        sampler = readers.BlockShuffleSampler(dataset, seed=seed, prefetch=False)
        stored = dataset.reader.storage_order()
        return {
            "batch_size": batch_size, "block_size": BLOCK_SIZE, "window": WINDOW,
            "storage_shuffled": stored is not None,
            "random": readers.class_entropy(labels, np.random.default_rng(seed).permutation(len(labels)), batch_size),
            "block": readers.class_entropy(labels, np.fromiter(sampler, np.int64), batch_size),
            "storage_order": readers.class_entropy(labels, np.arange(len(labels)) if stored is None else stored,
                                                   batch_size),
        }
    finally:
        dataset.close()


def run(args) -> dict:
    """Everything `python -m benchmarks run` does except printing; returns the results dict."""
    import torch
    from packer import scan_source

    started = time.time()
    workdir = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="packer-bench-")
    os.makedirs(workdir, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    notes = []
    if "cold" in args.cache and not cache.CAN_EVICT:
        notes.append("cold cases skipped: os.posix_fadvise is not available on this system")
        args.cache = [s for s in args.cache if s != "cold"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        notes.append(f"--device {device} requested but CUDA is not available: ran on cpu")
        device = "cpu"
    opts = Options(budget=args.budget, warmup=args.warmup, repeat=args.repeat, batch_size=args.batch_size,
                   workers=args.workers if args.workers is not None else available_cores(),
                   device=device, step_ms=args.step_ms, seed=args.seed)
    try:
        if args.data:
            folder, generated = os.path.abspath(args.data), False
        else:
            folder, generated = os.path.join(workdir, "corpus"), True
            reuse_corpus(folder, args.generate, args.seed)
        corpus = {"path": folder, "generated": generated, "images": scan_source(folder).count,
                  "bytes": tree_bytes(folder)}
        results = {
            "schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
            "command": ["python", "-m", "benchmarks", *args.argv],
            "machine": machine.describe(workdir),
            "config": {**asdict(opts), "formats": args.formats, "measures": args.measures, "cache": args.cache,
                       "peers": not args.no_peers, "isolation": args.isolation, "workdir": workdir,
                       "warm_compacts": cache.can_compact(),
                       "corpus": corpus,
                       "descriptions": {**{m: MEASURES[m].description for m in args.measures},
                                        "ceiling": CEILING.description, "disk": DISK.description,
                                        "memory_copy": MemoryCopy.description,
                                        "bare_read": BareRead.description}},
            "notes": notes,
            "sources": {},
        }
        packed, results["pack"] = pack_formats(args.formats, folder, workdir, opts.workers or 1, args.repeat,
                                               opts.workers, args.pack_cache)
        ctx = {"folder": folder, "packed": packed}
        for r in run_children(plan(args, ctx, results["sources"]), ctx, opts, workdir):
            if r["measure"] in ("ceiling", "disk"):
                results[r["measure"]] = r
            else:
                results["sources"][r["source"]]["measures"].setdefault(r["measure"], {})[r["cache"]] = r
        results["mixing"] = mixing(ctx, opts.batch_size, opts.seed)
        results["ratios"] = report.ratios(results)
        results["seconds"] = time.time() - started
        return results
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def check_data(folder: str) -> str | None:
    """Why folder cannot be measured, or None: the one place scan errors become a message."""
    from packer import PackError, scan_source

    try:
        source = scan_source(folder)
    except PackError as exc:
        return str(exc)
    if len(source.splits) != 1:
        return (f"holds splits {', '.join(source.splits)}; the suite measures one ImageFolder tree, "
                f"so pass one of them, e.g. --data {os.path.join(folder, sorted(source.splits)[0])}")
    return None


def main(args) -> int:
    unknown = [f for f in args.formats if f not in PACKER_SOURCES]
    unknown += [m for m in args.measures if m not in MEASURES]
    unknown += [s for s in args.cache if s not in CACHE_STATES]
    if unknown:
        log(f"unknown choice(s): {', '.join(unknown)}; formats: {', '.join(PACKER_SOURCES)}; "
            f"measures: {', '.join(MEASURES)}; cache: {', '.join(CACHE_STATES)}")
        return 2
    if args.data:
        problem = check_data(args.data)
        if problem:
            log(f"--data {args.data}: {problem}")
            return 2
    try:
        results = run(args)
    except WorkdirError as exc:
        log(f"--workdir {args.workdir}: {exc}")
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        log(f"wrote {args.out}")
    print(report.markdown(results))
    if args.chart:
        log(report.chart(results, args.chart))
    return 0
