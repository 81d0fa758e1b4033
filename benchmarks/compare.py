"""Compares two results.json files and fails on a regression: the nightly CI gate.

Throughputs (samples/s) regress when they fall by more than the tolerance; pack times
when they rise by more than it. A case that produced a figure before and an error now
is a regression too; a case absent from either file is listed, not judged. The
references (the decode ceiling, `tar cf`) are shown for context, not judged: they
measure the machine, and a slower machine shows in them first.

A gate must not pass what it cannot judge: a median that is not a finite positive number
(NaN, infinity, zero, a string) is a failure on either side, in OLD as much as in NEW (a
bad baseline would otherwise switch its case off for good), and so is a NEW with no
judged figure at all (`{}`, or every case crashed). Exit codes: 0 no regression,
1 a regression or a figure that cannot be judged, 2 a file that cannot be read as results.
"""
from __future__ import annotations

import json
import math
import sys

OK, REGRESSED, UNREADABLE = 0, 1, 2
REFERENCES = ("ceiling decode", "pack tar")
# A case's status: "ok" has a median; "error" (run.py's word for a failed or crashed case
# process) and "crashed" have none. "n/a" (a format not built here) is not a result.
FAILED = ("error", "crashed")


class Unreadable(ValueError):
    """A results file that is not JSON, or not shaped as run.py writes it."""


def load(path: str) -> dict:
    """The results at path; Unreadable naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except OSError as exc:
        raise Unreadable(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise Unreadable(f"{path}: not JSON ({exc})") from exc
    if not isinstance(found, dict):
        raise Unreadable(f"{path}: a JSON {type(found).__name__}, not the object `python -m benchmarks run "
                         "--out` writes")
    return found


def section(results: dict, key: str, path: str) -> dict:
    value = results.get(key, {})
    if not isinstance(value, dict):
        raise Unreadable(f"{path}: {key!r} is a JSON {type(value).__name__}, not an object")
    return value


def figures(results: dict, path: str = "results") -> dict[str, tuple[object, bool]]:
    """Every comparable figure: name -> (the median, or None for a failed case; higher is better)."""
    out = {}

    def add(name: str, case, higher: bool) -> None:
        if not isinstance(case, dict) or case.get("status") not in ("ok", *FAILED):
            return
        out[name] = (case.get("median", "no median") if case["status"] == "ok" else None, higher)

    add("ceiling decode", results.get("ceiling"), True)
    for fmt, case in section(results, "pack", path).items():
        add(f"pack {fmt}", case, False)
    for source, entry in section(results, "sources", path).items():
        measures = entry.get("measures", {}) if isinstance(entry, dict) else None
        if not isinstance(measures, dict):
            raise Unreadable(f"{path}: sources.{source} has no 'measures' object")
        for measure, states in measures.items():
            if not isinstance(states, dict):
                raise Unreadable(f"{path}: sources.{source}.measures.{measure} is not an object")
            for state, case in states.items():
                add(f"{source} {measure} {state}", case, True)
    return out


def judgeable(value) -> bool:
    """Whether value is a median a change can be computed from: a finite number above zero."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def shown(value) -> str:
    if value is None:
        return "error"
    return f"{value:,.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


FAILING = ("REGRESSION", "UNJUDGED")


def judge(name: str, before: tuple[object, bool], after: tuple[object, bool], tolerance: float) -> tuple[str, str, bool]:
    """The verdict on one figure present in both files, as figures() gives it: (verdict, the
    report line, whether it was a judged case with a change). A verdict in FAILING fails the gate."""
    (x, higher), (y, _) = before, after
    judged = name not in REFERENCES
    if y is None or x is None:  # a case failed: a regression when it worked before
        verdict = "REGRESSION" if judged and x is not None else ""
        return verdict, f"{verdict:>10} {name}: {shown(x)} -> {shown(y)}", False
    if not (judgeable(x) and judgeable(y)):
        side = " and ".join(s for s, v in (("OLD", x), ("NEW", y)) if not judgeable(v))
        verdict = "UNJUDGED" if judged else "reference"
        return verdict, (f"{verdict:>10} {name}: {shown(x)} -> {shown(y)} "
                         f"({side} median is not a finite positive number)"), False
    change = (y - x) / x
    worse = judged and (change < -tolerance if higher else change > tolerance)
    verdict = "REGRESSION" if worse else ("ok" if judged else "reference")
    return verdict, f"{verdict:>10} {name}: {x:,.4g} -> {y:,.4g} ({change:+.1%})", judged


def compare(old: dict, new: dict, tolerance: float, names: tuple[str, str] = ("OLD", "NEW")) -> tuple[list[str], int]:
    """(report lines, number of failures: regressions, figures that cannot be judged, and
    a comparison that judged nothing)."""
    a, b = figures(old, names[0]), figures(new, names[1])
    lines, failures, judged_cases = [], 0, 0
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            lines.append(f"{'':>10} {name}: only in {'OLD' if name in a else 'NEW'}")
            continue
        verdict, line, judged = judge(name, a[name], b[name], tolerance)
        failures += verdict in FAILING
        judged_cases += judged
        lines.append(line)
    if not judged_cases:  # NEW is {}, every case crashed, or OLD and NEW share no measured case
        failures += 1
        lines.append(f"{'EMPTY':>10} no case was measured in both OLD and NEW: nothing was judged")
    return lines, failures


def machine_warnings(old: dict, new: dict, names: tuple[str, str]) -> list[str]:
    """Where the two runs' machines differ: a comparison across machines measures the machines."""
    out = []
    for key in ("cpu", "cpus_usable", "gpu"):
        was, now = section(old, "machine", names[0]).get(key), section(new, "machine", names[1]).get(key)
        if was != now:
            out.append(f"warning: machines differ in {key}: {was!r} vs {now!r}")
    return out


def main(args) -> int:
    try:
        old, new = load(args.old), load(args.new)
        for warning in machine_warnings(old, new, (args.old, args.new)):
            print(warning, file=sys.stderr)
        lines, failures = compare(old, new, args.tolerance, (args.old, args.new))
    except Unreadable as exc:
        print(f"cannot read results: {exc}; compare takes two files written by `python -m benchmarks run "
              f"--out` (exit {UNREADABLE})", file=sys.stderr)
        return UNREADABLE
    print("\n".join(lines))
    print(f"{failures} regression(s) beyond {args.tolerance:.0%} or unjudged figure(s)")
    return REGRESSED if failures else OK
