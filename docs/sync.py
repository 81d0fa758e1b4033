"""Refreshes the generated blocks of docs/*.md and of the results pages beside the results
(benchmarks/results/NOTES.md, the notebook, and STUDIES.md, the guides' measurements): byte
layouts from the format modules' docstrings (their one owner) and benchmark tables from
benchmarks/results/*.json.

    python docs/sync.py           rewrite the blocks in place
    python docs/sync.py --check   exit 1 if any block is stale (tests/test_docs.py runs this)

A block is the text between `<!-- generated: SOURCE -->` and `<!-- /generated -->`, where
SOURCE is a module (`packer/formats/lmdb.py`: its docstring, fenced) or a results file
(`benchmarks/results/NAME.json`: benchmarks.report.markdown of it; `NAME.json table`: only
its table, what the figures are and the machine, for the manual, whose notebook has the rest;
a study's file, `study-NAME.json`, through benchmarks.studies, and a benchmark's own results
file, `remote-*.json` or `scale-*.json`, through the module that wrote it (RENDERERS), for the
results page of the guides, benchmarks/results/STUDIES.md).
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
# The dated runs live beside their JSON, out of the manual; their tables come from it all the same.
NOTEBOOK = os.path.join(ROOT, "benchmarks", "results", "NOTES.md")
# The measurements the guides rest on, one section a guide, each table from its study's file.
STUDIES = os.path.join(ROOT, "benchmarks", "results", "STUDIES.md")
# Results files that are not a suite run (benchmarks.report), by name: the module that renders them.
RENDERERS = (("study-", "benchmarks.studies"), ("remote-", "benchmarks.remote"), ("scale-tiny-", "benchmarks.tiny"),
             ("scale-", "benchmarks.scale"))
BLOCK = re.compile(r"(<!-- generated: (?P<source>\S+)(?: (?P<mode>table))? -->\n)(?P<body>.*?)(<!-- /generated -->)",
                   re.S)


def render(source: str, mode: str | None = None) -> str:
    path = os.path.join(ROOT, source)
    if source.endswith(".py"):
        with open(path, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()), clean=True)
        return f"```text\n{doc}\n```\n"
    if source.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
        if os.path.basename(source).startswith(tuple(prefix for prefix, _ in RENDERERS)):
            return results_markdown(results, source)
        sys.path.insert(0, ROOT)
        from benchmarks.report import markdown

        lines = markdown(results).rstrip("\n").split("\n")
        if mode == "table":  # the rows, then "Figures are ..." and "Machine: ..."
            rows = [line for line in lines if line.startswith("|")]
            lines = rows + [""] + [line for line in lines if line.startswith(("Figures are", "Machine:"))]
        return "\n".join(lines) + "\n"
    raise ValueError(f"{source}: a generated block's source must be a .py module or a results .json")


def results_markdown(results: dict, source: str) -> str:
    """A results file that is not a suite run, by its name: the module that wrote it renders it."""
    import importlib

    sys.path.insert(0, ROOT)
    name = os.path.basename(source)
    module = next(module for prefix, module in RENDERERS if name.startswith(prefix))
    return importlib.import_module(module).markdown(results)


def refreshed(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("source"), m.group("mode")) + m.group(5), text)


def pages() -> list[str]:
    found = [os.path.join(DOCS, name) for name in sorted(os.listdir(DOCS)) if name.endswith(".md")]
    return found + [page for page in (NOTEBOOK, STUDIES) if os.path.exists(page)]


def stale_pages() -> list[str]:
    """The pages, relative to docs/, whose generated blocks differ from what their sources give now."""
    stale = []
    for path in pages():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if refreshed(text) != text:
            stale.append(os.path.relpath(path, DOCS))
    return stale


def shown(name: str) -> str:
    return os.path.relpath(os.path.join(DOCS, name), ROOT)


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_pages()
        for name in stale:
            print(f"{shown(name)}: generated blocks are stale; run `python docs/sync.py`", file=sys.stderr)
        return 1 if stale else 0
    for name in stale_pages():
        path = os.path.join(DOCS, name)
        with open(path, encoding="utf-8") as f:
            text = refreshed(f.read())
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"updated {shown(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
