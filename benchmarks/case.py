"""Runs benchmark cases in a fresh process: `python -m benchmarks.case SPEC.json OUT.json`.

A fresh process per case keeps one case's open maps, allocator state and imported
caches from leaking into the next. Each case: untimed setup, an untimed warm-up run,
then `repeat` timed runs, each preceded by making the source's files cold or warm and
checking the page cache with mincore. A warm raw run is also preceded by the memory-copy
reference (measures.MemoryCopy) and, for packed map-style sources, the bare-read
reference on the same cached pages (measures.BareRead), timed in the same state of the
machine. Failures are
recorded per case, never raised.

The cases of an e2e cell (one cache state, every source) run in one process, round by
round (run_cell): their rows differ by a few percent, less than a shared machine's speed
drifts between cases run minutes apart, so each round runs every source once with one
seed, and each source's ratio to the folder is taken within the round.

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


class CaseRun:
    """One (source, measure, cache state) case, taken a timed run at a time, so the cases of
    a cell can be run round by round (run_cell) as well as one after the other (run_case)."""

    def __init__(self, case: dict, ctx: dict, opts: Options):
        self.case, self.ctx, self.opts = case, ctx, opts
        self.source = SOURCES.get(case["source"]) if case["source"] else None
        self.measure = {"ceiling": CEILING, "disk": DISK}.get(case["measure"]) or MEASURES[case["measure"]]
        self.state = case.get("cache")
        self.runs, self.resident, self.resident_after, self.copies, self.bare = [], [], [], [], []
        self.failure: dict | None = None

    def attempt(self, work) -> bool:
        """work() unless the case has failed; a failure is recorded, never raised: one broken
        case must not take the others down."""
        if self.failure is None:
            try:
                work()
            except Exception as exc:
                self.failure = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc(limit=-4)}
        return self.failure is None

    def setup(self) -> None:
        """The untimed setup, then the untimed warm-up run."""
        source, ctx, opts, state = self.source, self.ctx, self.opts, self.state
        self.bench = self.measure.setup(source, ctx, opts)
        self.files = source.files(ctx) if (source is not None and state) else []
        warm_raw = (self.case["measure"], state) == ("raw", "warm")
        self.reference = MemoryCopy.of_corpus(ctx["folder"]) if warm_raw else None
        self.passes = {"epochs": None} if state == "warm" and isinstance(self.measure, ItemLoop) else {}
        self.bench.run(source, ctx, opts, opts.warmup, opts.seed)  # warm-up, excluded

    def timed(self, r: int) -> None:
        """Timed run r (seed opts.seed + 1 + r), after putting the cache in the case's state."""
        source, ctx, opts, state = self.source, self.ctx, self.opts, self.state
        seed = opts.seed + 1 + r
        if state:
            self.resident.append(cache.prepare(self.files, state))
        if self.reference is not None:
            self.copies.append(self.reference.rate(min(REFERENCE_S, opts.budget), seed))
            self.bare.append(BareRead.rate_of(source, ctx, min(REFERENCE_S, opts.budget), seed))
        self.runs.append(self.bench.run(source, ctx, opts, opts.budget, seed, **self.passes))
        if state == "warm":
            self.resident_after.append(cache.resident_fraction(self.files))

    def result(self) -> dict:
        if self.failure is not None:
            return {**self.case, **self.failure}
        return summarise_case(self.case, self.measure, self.source, self.state, self.runs, self.resident,
                              self.resident_after, self.copies, self.bare)


def run_case(case: dict, ctx: dict, opts: Options) -> dict:
    """One (source, measure, cache state) case -> its figures, or the reason it failed."""
    run = CaseRun(case, ctx, opts)
    run.attempt(run.setup)
    for r in range(opts.repeat):
        if not run.attempt(lambda: run.timed(r)):
            break
    return run.result()


def run_cell(cases: list[dict], ctx: dict, opts: Options) -> list[dict]:
    """The cases of one cell (one measure and cache state, every source), interleaved: after
    each case's setup and warm-up, round r runs every source's timed run r, starting one
    source further along each round (A B C, B C A, ...), so a drift in the machine's speed
    over minutes falls on every source alike instead of on whichever ran last.

    Every run of a round has the same seed: with the e2e measure, the map-style sources
    then read the same records in the same order and draw the same crops, so a round's
    ratio compares one workload read different ways. Each source's ratio to the folder
    is computed round by round; its median and range are the result's "vs_folder".
    """
    runs = [CaseRun(case, ctx, opts) for case in cases]
    for run in runs:
        run.attempt(run.setup)
    for r in range(opts.repeat):
        for run in runs[r % len(runs):] + runs[:r % len(runs)]:
            run.attempt(lambda: run.timed(r))
    results = [run.result() for run in runs]
    add_round_ratios(results)
    return results


def add_round_ratios(results: list[dict]) -> None:
    """Each ok case's rate over the folder's of the same round, summarised as "vs_folder"."""
    folder = next((r for r in results if r["source"] == "folder" and r["status"] == "ok"), None)
    if folder is None:
        return
    for result in results:
        if result is folder or result["status"] != "ok" or len(result["runs"]) != len(folder["runs"]):
            continue
        result["vs_folder"] = summarise([a / b for a, b in zip(result["runs"], folder["runs"])])
        ours, theirs = cpu_per_sample(result), cpu_per_sample(folder)
        if ours and theirs:  # the folder's CPU per sample over this source's, round by round: > 1 is cheaper
            result["cpu_vs_folder"] = summarise([b / a for a, b in zip(ours, theirs)])


def cpu_per_sample(result: dict) -> list[float] | None:
    """Each timed run's CPU ms per sample, main process and workers together, or None."""
    cpu = result.get("cpu_ms_per_sample") or {}
    if not cpu.get("main") or not cpu.get("workers"):
        return None
    return [a + b for a, b in zip(cpu["main"]["runs"], cpu["workers"]["runs"])]


def summarise_case(case: dict, measure, source, state, runs: list[dict], resident: list, resident_after: list,
                   copies: list, bare: list) -> dict:
    """A case's figures from its timed runs: the rates' median and range, and what qualifies them."""
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
    if all(r.get("vs_raw") for r in runs):  # the checked measure: unchecked reads timed in the same runs
        result["raw_rate"] = summarise([r["raw_rate"] for r in runs])
        result["vs_raw"] = summarise([r["vs_raw"] for r in runs])
    if "open_s" in runs[0]:
        result["open_s"] = summarise([r["open_s"] for r in runs])
    if "wait_fraction" in runs[0]:
        result["wait_fraction"] = summarise([r["wait_fraction"] for r in runs])
        startups = [r["startup_s"] for r in runs if r["startup_s"] is not None]
        result["startup_s"] = summarise(startups) if startups else None
        result["how"], result["step"] = runs[0]["how"], runs[0]["step"]
        cpu = [r["cpu_ms_per_sample"] for r in runs if r.get("cpu_ms_per_sample")]
        if len(cpu) == len(runs):
            result["cpu_ms_per_sample"] = {part: summarise([c[part] for c in cpu])
                                           if None not in [c[part] for c in cpu] else None
                                           for part in ("main", "workers")}
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
    if spec.get("interleave"):
        results = run_cell(spec["cases"], spec["ctx"], opts)
    else:
        results = [run_case(case, spec["ctx"], opts) for case in spec["cases"]]
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
