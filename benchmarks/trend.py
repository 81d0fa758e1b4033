"""`python -m benchmarks trend`: every figure `compare` judges, over a series of results files
(one a night), as a table on stdout and a PNG, with what `compare` would call a regression marked.

Each night is judged as the nightly job judges it (docs/benchmarks.md, "Every night"): by
`compare` against the last good night before it, the last one whose comparison passed; the
first file is the first baseline. A night that fails stays in the series but does not become
the baseline, so a slow drift of a few percent a night is caught once it adds up to the
tolerance. The verdicts are compare's own (`compare.judge`), never recomputed here.
Exit codes: 0 the series was shown, 2 a file that cannot be read as results (as compare).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

from . import compare

MARKS = {"REGRESSION": " !", "UNJUDGED": " ?"}


@dataclass
class Night:
    """One results file of the series and compare's verdict on it."""

    name: str
    results: dict
    figures: dict[str, tuple[object, bool]]
    baseline: str | None = None  # the night it was compared with; None for the first
    failures: int = 0
    lines: list[str] = field(default_factory=list)  # compare's failing lines
    verdicts: dict[str, str] = field(default_factory=dict)


def night_name(path: str) -> str:
    base = os.path.basename(path)
    return base[:-5] if base.endswith(".json") else base


def load(paths: list[str]) -> list[Night]:
    """Every file as a Night, in the order given; compare.Unreadable naming a bad one."""
    nights = []
    for path in paths:
        results = compare.load(path)
        nights.append(Night(night_name(path), results, compare.figures(results, path)))
    return nights


def judge_series(nights: list[Night], tolerance: float) -> list[str]:
    """Compare each night with the last good one before it; returns machine warnings."""
    warnings, good = [], nights[0] if nights else None
    for night in nights[1:]:
        night.baseline = good.name
        warnings += [f"{night.name}: {w}" for w in compare.machine_warnings(good.results, night.results,
                                                                            (good.name, night.name))]
        lines, night.failures = compare.compare(good.results, night.results, tolerance, (good.name, night.name))
        night.lines = [line for line in lines if line.split()[:1] and line.split()[0] in (*compare.FAILING, "EMPTY")]
        for name in good.figures.keys() & night.figures.keys():
            night.verdicts[name] = compare.judge(name, good.figures[name], night.figures[name], tolerance)[0]
        if not night.failures:
            good = night
    return warnings


def cell(value) -> str:
    if value is None:
        return "error"
    if not compare.judgeable(value):
        return compare.shown(value)
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def table(nights: list[Night], tolerance: float) -> str:
    """A Markdown table: one row per figure, one column per night, marks where compare fails it."""
    names = sorted(set().union(*(n.figures for n in nights)))
    out = ["| figure | " + " | ".join(n.name for n in nights) + " |", "|---" + "|---:" * len(nights) + "|"]
    for name in names:
        cells = []
        for n in nights:
            if name not in n.figures:
                cells.append("–")
                continue
            cells.append(cell(n.figures[name][0]) + MARKS.get(n.verdicts.get(name, ""), ""))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    gate = ["baseline"] + [f"{'FAIL' if n.failures else 'pass'} vs {n.baseline}" for n in nights[1:]]
    out.append("| compare (exit 1 = FAIL) | " + " | ".join(gate) + " |")
    out.append("")
    out.append(f"Samples/s, pack and ceiling times in s (lower is better for pack). Each night is compared with the "
               f"last good night before it at --tolerance {tolerance:g}; ! marks a regression, ? a figure compare "
               "cannot judge, as `python -m benchmarks compare` reports them:")
    failed = [n for n in nights if n.failures]
    for n in failed:
        out.append(f"- {n.name} against {n.baseline}:")
        out += [f"  - {line.strip()}" for line in n.lines]
    if not failed:
        out.append("- none")
    return "\n".join(out)


def group(name: str) -> tuple[str, str]:
    """(panel, line) for a figure name: `lmdb raw warm` is line lmdb in panel `raw warm`."""
    if name.startswith("pack "):
        return "pack s", name[5:]
    if name == "ceiling decode":
        return "ceiling decode", "ceiling"
    parts = name.rsplit(" ", 2)
    return (f"{parts[1]} {parts[2]}", parts[0]) if len(parts) == 3 else (name, name)


def chart(nights: list[Night], path: str) -> str:
    """Write one panel per measure and cache state, one line per source; returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"no PNG written to {path}: matplotlib is not installed (pip install 'packer[plot]'); "
                "the table above holds every figure")
    panels: dict[str, dict[str, str]] = {}
    for name in sorted(set().union(*(n.figures for n in nights))):
        panel, line = group(name)
        panels.setdefault(panel, {})[line] = name
    cols = min(4, max(1, len(panels)))
    rows = -(-len(panels) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    x = range(len(nights))
    for ax, (panel, lines) in zip(axes.flat, sorted(panels.items())):
        for line, name in lines.items():
            ys = [n.figures[name][0] if name in n.figures and compare.judgeable(n.figures[name][0]) else float("nan")
                  for n in nights]
            ax.plot(x, ys, marker=".", label=line)
            bad = [i for i, n in enumerate(nights) if n.verdicts.get(name) in compare.FAILING and not math.isnan(ys[i])]
            ax.plot(bad, [ys[i] for i in bad], "x", color="red", markersize=9, markeredgewidth=2)
        ax.set_title(panel, fontsize=9)
        ax.set_xticks(list(x))
        ax.set_xticklabels([n.name for n in nights], rotation=45, ha="right", fontsize=6)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("packer benchmarks night by night (red x: what compare calls a regression)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"


def main(args) -> int:
    try:
        nights = load(args.results)
        warnings = judge_series(nights, args.tolerance)
    except compare.Unreadable as exc:
        print(f"cannot read results: {exc}; trend takes files written by `python -m benchmarks run --out` "
              f"(exit {compare.UNREADABLE})", file=sys.stderr)
        return compare.UNREADABLE
    for warning in warnings:
        print(warning, file=sys.stderr)
    print(table(nights, args.tolerance))
    if args.png:
        print(chart(nights, args.png), file=sys.stderr)
    return 0
