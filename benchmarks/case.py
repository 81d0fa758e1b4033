"""Runs benchmark cases in a fresh process: `python -m benchmarks.case SPEC.json OUT.json`.

A fresh process per case keeps one case's open maps, allocator state and imported
caches from leaking into the next. Each case: untimed setup, an untimed warm-up run,
then `repeat` timed runs, each preceded by making the source's files cold or warm and
checking the page cache with mincore. A warm raw run is also preceded by the memory-copy
reference (measures.MemoryCopy) and, for packed map-style sources, the bare-read
reference on the same cached pages (measures.BareRead), timed in the same state of the
machine. Failures are
recorded per case, never raised.

A cold run reads the data once: a second pass would find it cached. A warm single-process
run reads epoch after epoch (each its own order) until its budget is spent, as training
does on a warm cache, and mincore checks afterwards that the data stayed resident: one
pass of raw reads lasts well under a second (20,000 records in 0.35 s here), short
enough for a momentary stall of a shared machine to decide a run's figure.
"""
from __future__ import annotations

import json
import statistics
import sys
import traceback

from . import cache
from .measures import CEILING, DISK, MEASURES, BareRead, ItemLoop, MemoryCopy, Options
from .sources import SOURCES


REFERENCE_S = 1.0  # seconds of memory-copy reference before each warm raw run


def summarise(values: list[float]) -> dict:
    median = statistics.median(values)
    lo, hi = min(values), max(values)
    return {"median": median, "min": lo, "max": hi, "spread": (hi - lo) / median if median else None,
            "runs": values}


def run_case(case: dict, ctx: dict, opts: Options) -> dict:
    """One (source, measure, cache state) case -> its figures, or the reason it failed."""
    source = SOURCES.get(case["source"]) if case["source"] else None
    measure = {"ceiling": CEILING, "disk": DISK}.get(case["measure"]) or MEASURES[case["measure"]]
    state = case.get("cache")
    try:
        bench = measure.setup(source, ctx, opts)
        files = source.files(ctx) if (source is not None and state) else []
        reference = MemoryCopy.of_corpus(ctx["folder"]) if (case["measure"], state) == ("raw", "warm") else None
        passes = {"epochs": None} if state == "warm" and isinstance(measure, ItemLoop) else {}
        bench.run(source, ctx, opts, opts.warmup, opts.seed)  # warm-up, excluded
        runs, resident, resident_after, copies, bare = [], [], [], [], []
        for r in range(opts.repeat):
            if state:
                resident.append(cache.prepare(files, state))
            if reference is not None:
                copies.append(reference.rate(min(REFERENCE_S, opts.budget), opts.seed + 1 + r))
                bare.append(BareRead.rate_of(source, ctx, min(REFERENCE_S, opts.budget), opts.seed + 1 + r))
            runs.append(bench.run(source, ctx, opts, opts.budget, opts.seed + 1 + r, **passes))
            if state == "warm":
                resident_after.append(cache.resident_fraction(files))
    except Exception as exc:  # one broken case must not take the run down
        return {**case, "status": "error", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=-4)}
    result = {**case, "status": "ok", "unit": "MB/s" if measure is DISK else "samples/s",
              **summarise([r["samples"] / r["seconds"] for r in runs]),
              "samples": [r["samples"] for r in runs]}
    if case["measure"] == "augment":
        result["how"] = source.augment_description()
    if "mb_per_s" in runs[0]:
        result["mb_per_s"] = summarise([r["mb_per_s"] for r in runs])
    if copies:
        result["memory_copy"] = summarise(copies)
    if bare and None not in bare:
        result["bare_read"] = summarise(bare)
    if "open_s" in runs[0]:
        result["open_s"] = summarise([r["open_s"] for r in runs])
    if "wait_fraction" in runs[0]:
        result["wait_fraction"] = summarise([r["wait_fraction"] for r in runs])
        startups = [r["startup_s"] for r in runs if r["startup_s"] is not None]
        result["startup_s"] = summarise(startups) if startups else None
        result["how"], result["step"] = runs[0]["how"], runs[0]["step"]
    notes = sorted({r["note"] for r in runs if r.get("note")})
    if state:
        verified, note = cache.verdict(state, resident, resident_after)
        result["resident"] = resident
        if resident_after:
            result["resident_after"] = resident_after
        result["cache_verified"] = verified
        notes += [note] if note else []
    if notes:
        result["note"] = "; ".join(notes)
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    # The single-process measures are per core; intra-op threads would blur that.
    torch.set_num_threads(1)
    opts = Options(**spec["opts"])
    results = [run_case(case, spec["ctx"], opts) for case in spec["cases"]]
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
