"""Compares two results.json files and fails on a regression: the nightly CI gate.

Throughputs (samples/s) regress when they fall by more than the tolerance; pack times
when they rise by more than it. A case that produced a figure before and an error now
is a regression too; a case absent from either file is listed, not judged. The
references (the decode ceiling, `tar cf`) are shown for context, not judged: they
measure the machine, and a slower machine shows in them first.
"""
from __future__ import annotations

import json
import sys


REFERENCES = ("ceiling decode", "pack tar")


def figures(results: dict) -> dict[str, tuple[float | None, bool]]:
    """Every comparable figure: name -> (value, or None for an error; higher is better)."""
    out = {}

    def add(name: str, case: dict | None, higher: bool) -> None:
        if not case or case.get("status") not in ("ok", "error"):
            return
        out[name] = (case["median"] if case["status"] == "ok" else None, higher)

    add("ceiling decode", results.get("ceiling"), True)
    for fmt, case in results.get("pack", {}).items():
        add(f"pack {fmt}", case, False)
    for source, entry in results.get("sources", {}).items():
        for measure, states in entry.get("measures", {}).items():
            for state, case in states.items():
                add(f"{source} {measure} {state}", case, True)
    return out


def compare(old: dict, new: dict, tolerance: float) -> tuple[list[str], int]:
    """(report lines, number of regressions)."""
    a, b = figures(old), figures(new)
    lines, regressions = [], 0
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            lines.append(f"{'':>10} {name}: only in {'OLD' if name in a else 'NEW'}")
            continue
        (x, higher), (y, _) = a[name], b[name]
        judged = name not in REFERENCES
        if x is None or y is None:
            worse = judged and x is not None
            regressions += worse
            lines.append(f"{'REGRESSION' if worse else '':>10} {name}: {'error' if x is None else f'{x:,.4g}'} -> "
                         f"{'error' if y is None else f'{y:,.4g}'}")
            continue
        change = (y - x) / x if x else 0.0
        worse = judged and (change < -tolerance if higher else change > tolerance)
        regressions += worse
        verdict = "REGRESSION" if worse else ("ok" if judged else "reference")
        lines.append(f"{verdict:>10} {name}: {x:,.4g} -> {y:,.4g} ({change:+.1%})")
    return lines, regressions


def main(args) -> int:
    try:
        docs = []
        for path in (args.old, args.new):
            with open(path) as f:
                docs.append(json.load(f))
    except (OSError, ValueError) as exc:
        print(f"cannot read results: {exc}", file=sys.stderr)
        return 2
    old, new = docs
    for key in ("cpu", "cpus_usable", "gpu"):
        if old.get("machine", {}).get(key) != new.get("machine", {}).get(key):
            print(f"warning: machines differ in {key}: {old.get('machine', {}).get(key)!r} vs "
                  f"{new.get('machine', {}).get(key)!r}", file=sys.stderr)
    lines, regressions = compare(old, new, args.tolerance)
    print("\n".join(lines))
    print(f"{regressions} regression(s) beyond {args.tolerance:.0%}")
    return 1 if regressions else 0
