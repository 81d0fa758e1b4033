"""The CUDA tests: the one list of the tests that do something different where CUDA is present,
run with a junit report and counted.

    python benchmarks/suites/cuda_tests.py [TEST ...] [--junit tests.xml] [--json out.json]

A test file that skips a test without CUDA belongs in CUDA_TESTS (tests/test_gpu_entry.py
checks it), so a GPU run (`python -m benchmarks gpu --steps tests`) runs every such test.
Without CUDA the tests run their CPU side and skip the rest, each skip with its reason.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
CUDA_TESTS = ["tests/test_gpu.py", "tests/test_nvjpeg.py", "tests/test_resize.py", "tests/test_collate.py",
              "tests/test_loader.py", "tests/test_handover.py",
              "tests/test_benchmarks.py::test_cuda_is_used_when_present_and_its_absence_is_reported"]


def junit_counts(path: str) -> dict:
    """Tests, failures, errors and skips of a junit report; the failed tests' names and the skip reasons."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    counts["skip_reasons"] = sorted({(c.find("skipped").get("message") or "")[:200] for s in suites
                                     for c in s.iter("testcase") if c.find("skipped") is not None})
    return counts


def tests_rootdir(tests: list[str], root: str = ROOT) -> str:
    """The inner pytest's rootdir, which names the tests in the junit report: the repository for
    its own tests, else the folder holding the given ones. Left to pytest, it is the common
    ancestor of the clone and the tests, so a clone under /tmp named a test under /tmp by its path."""
    files = [os.path.abspath(os.path.join(root, t.split("::")[0])) for t in tests if not t.startswith("-")]
    if not files:
        return root
    common = os.path.commonpath([os.path.dirname(f) for f in files])
    return root if common == root or common.startswith(root + os.sep) else common


def pytest_command(tests: list[str], junit: str, root: str = ROOT) -> list[str]:
    """pytest over `tests` (run from `root`), its junit report written to `junit`, in one process:
    the GPU machine need not carry pytest-xdist, which pyproject.toml's addopts would ask for."""
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-p", "no:cacheprovider",
            f"--junitxml={junit}", f"--rootdir={tests_rootdir(tests, root)}", *tests]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("tests", nargs="*", default=CUDA_TESTS, help="pytest arguments (default: CUDA_TESTS)")
    p.add_argument("--junit", default="cuda-tests.xml", help="the junit report (default: cuda-tests.xml)")
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args(argv)
    code = subprocess.run(pytest_command(args.tests, args.junit), cwd=ROOT).returncode
    counts = {"exit_code": code, **(junit_counts(args.junit) if os.path.exists(args.junit) else {})}
    keys = ("tests", "failures", "errors", "skipped")
    print("| " + " | ".join(keys) + " |\n" + "|---:" * len(keys) + "|")
    print("| " + " | ".join(str(counts.get(k, "–")) for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
