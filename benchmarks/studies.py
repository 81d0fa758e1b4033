"""Renders a study's results file (benchmarks/results/study-*.json) as Markdown for the results pages.

A study is a measurement a guide rests on, taken once by hand or by a suite under
benchmarks/suites/, whose figures were reported in prose and tables. Its file keeps those
figures as they were reported, with what produced them:

    study       its name (the file is study-<name>.json)
    guide       the page of docs/ that links to it
    date        when the figures were taken (YYYY-MM-DD; the commit that reported them)
    provenance  where they were first reported (page and commit), so they can be traced
    machine     the machine and its load while measuring
    command     the command(s) that produced them ("" where the method is described in the text)
    blocks      in order: {"text": ...}, {"table": {"head", "align", "rows"}}, {"command": ...}

docs/sync.py fills the generated blocks of benchmarks/results/STUDIES.md from these files,
so the figures are the files'; the guides link there and hold none of their own.
"""
from __future__ import annotations

import re

FIELDS = ("study", "guide", "date", "provenance", "machine", "command", "blocks")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def check(study: dict, name: str) -> None:
    """Refuse a study file without the fields that say what produced its figures."""
    missing = [field for field in FIELDS if field not in study or (field != "command" and not study[field])]
    if missing:
        raise ValueError(f"{name}: a study needs {', '.join(missing)} (benchmarks/studies.py says what each holds)")
    if not DATE.fullmatch(study["date"]):
        raise ValueError(f"{name}: date {study['date']!r} is not YYYY-MM-DD")
    for block in study["blocks"]:
        if len(block) != 1 or next(iter(block)) not in ("text", "table", "command"):
            raise ValueError(f"{name}: a block is one of text, table or command, not {sorted(block)}")


def table(spec: dict) -> list[str]:
    head, rows = spec["head"], spec["rows"]
    if any(len(row) != len(head) for row in rows):
        raise ValueError(f"a table's rows must have its head's {len(head)} cells: {head}")
    rule = ["---:" if side == "right" else "---" for side in spec.get("align", ["left"] * len(head))]
    return ["| " + " | ".join(cells) + " |" for cells in [head, rule, *rows]]


def markdown(study: dict) -> str:
    """The study as Markdown: when, where and how it was measured, then its blocks as reported."""
    check(study, f"study-{study.get('study')}.json")
    lines = [f"Measured {study['date']} on {study['machine']}; first reported in {study['provenance']}; "
             f"the guide: [docs/{study['guide']}](../../docs/{study['guide']}).", ""]
    if study["command"]:
        lines += ["```bash", study["command"], "```", ""]
    for block in study["blocks"]:
        if "text" in block:
            lines += [block["text"], ""]
        elif "table" in block:
            lines += table(block["table"]) + [""]
        else:
            lines += ["```bash", block["command"], "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"
