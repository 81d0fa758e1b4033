"""`python -m benchmarks trend` (benchmarks/trend.py) and the nightly recipe of docs/benchmarks.md."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import main as bench_main
from test_docs import load_sync

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def night(rate: float, pack_s: float = 10.0, status: str = "ok") -> dict:
    case = {"status": "ok", "median": rate} if status == "ok" else {"status": "error", "error": "boom"}
    return {"machine": {"cpu": "x"}, "ceiling": {"status": "ok", "median": 500.0},
            "pack": {"lmdb": {"status": "ok", "median": pack_s}},
            "sources": {"lmdb": {"measures": {"raw": {"warm": case}}}}}


def write_nights(tmp_path: Path, *nights: dict) -> list[str]:
    paths = []
    for i, results in enumerate(nights, 1):
        path = tmp_path / f"night{i}.json"
        path.write_text(json.dumps(results))
        paths.append(str(path))
    return paths


def row(out: str, figure: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(f"| {figure} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_a_night_is_judged_against_the_last_good_one(tmp_path, capsys):
    # night2 fell 15%: a regression, so night3 (4% under night1) is judged against night1, not night2.
    paths = write_nights(tmp_path, night(1000.0), night(850.0), night(960.0), night(0.0, status="error"))
    assert bench_main(["trend", *paths, "--png", ""]) == 0
    out = capsys.readouterr().out
    assert row(out, "lmdb raw warm") == ["1,000", "850 !", "960", "error !"]
    assert row(out, "pack lmdb") == ["10", "10", "10", "10"]
    assert row(out, "compare (exit 1 = FAIL)") == ["baseline", "FAIL vs night1", "pass vs night1", "FAIL vs night3"]
    assert "REGRESSION lmdb raw warm: 1,000 -> 850 (-15.0%)" in out


def test_the_tolerance_is_compares(tmp_path, capsys):
    paths = write_nights(tmp_path, night(1000.0), night(850.0))
    assert bench_main(["trend", *paths, "--png", "", "--tolerance", "0.2"]) == 0
    assert row(capsys.readouterr().out, "lmdb raw warm") == ["1,000", "850"]


def committed_series() -> list[str]:
    paths = [str(RESULTS / f"cpu-2core-20k-paired-{n}.json") for n in (3, 4)]
    if not all(os.path.exists(p) for p in paths):
        pytest.skip("the committed 2-core results are not in this checkout")
    return paths


def test_the_marks_on_committed_results_are_what_compare_reports(capsys):
    old, new = committed_series()
    assert bench_main(["compare", old, new]) == 1
    regressed = set(re.findall(r"REGRESSION (.+?): ", capsys.readouterr().out))
    assert bench_main(["trend", old, new, "--png", ""]) == 0
    out = capsys.readouterr().out
    marked = {line.split(" | ")[0][2:] for line in out.splitlines() if line.endswith(" ! |")}
    assert regressed and marked == regressed
    assert row(out, "compare (exit 1 = FAIL)") == ["baseline", "FAIL vs cpu-2core-20k-paired-3"]


def test_the_png_shows_the_series(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "trend.png"
    assert bench_main(["trend", *committed_series(), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_table_is_shown_and_the_missing_png_said(tmp_path):
    paths = write_nights(tmp_path, night(1000.0), night(990.0))
    # A real process in which matplotlib cannot be imported, installed here or not.
    code = ("import sys; sys.modules['matplotlib'] = None; from benchmarks.__main__ import main; "
            f"sys.exit(main(['trend', *{paths!r}, '--png', {str(tmp_path / 'trend.png')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| lmdb raw warm | 1,000 | 990 |" in done.stdout
    assert "no PNG written" in done.stderr and "matplotlib is not installed" in done.stderr
    assert not (tmp_path / "trend.png").exists()


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it"),
    ("{not json", "not JSON"),
    ("[1, 2]", "a JSON list"),
    ('{"sources": {"lmdb": {"measures": 3}}}', "has no 'measures' object"),
], ids=["missing", "malformed", "a-list", "bad-sources"])
def test_a_file_that_is_not_results_is_named_with_exit_2(tmp_path, capsys, content, says):
    """In this process (the command's exit status is main's; the nightly recipe's test runs the
    command itself): an error raised instead of the message would fail the test."""
    good = write_nights(tmp_path, night(1000.0))[0]
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert bench_main(["trend", good, str(bad), "--png", ""]) == 2
    out, err = capsys.readouterr()
    assert f"{bad}: " in err and says in err, err
    assert "Traceback" not in err and out == ""


def nightly_script() -> str:
    manual = (ROOT / "docs" / "benchmarks.md").read_text()
    return next(block for block in re.findall(r"```sh\n(.*?)```", manual, re.S) if "# nightly.sh" in block)


def test_the_manuals_nightly_recipe_runs_and_keeps_the_history(tmp_path):
    script = tmp_path / "nightly.sh"
    script.write_text(nightly_script())
    history = tmp_path / "history"
    env = {**ENV, "PACKER_CHECKOUT": str(ROOT), "BENCH_HISTORY": str(history), "PATH": os.path.dirname(sys.executable)
           + os.pathsep + os.environ["PATH"],
           # a --workdir, as the recipe's own default has: the second night reuses the first's corpus
           "BENCH_RUN_ARGS": "--generate 16 --formats lmdb --measures raw --cache warm --no-peers --repeat 1 "
                             f"--budget 0.05 --warmup 0.01 --isolation run --workers 1 --workdir {tmp_path / 'work'}"}
    codes = []
    for _ in range(2):
        done = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=240)
        codes.append(done.returncode)
        assert done.returncode in (0, 1), done.stderr[-2000:]
    nights = sorted((history / "nights").glob("*.json"))
    assert len(nights) == 2 and codes[0] == 0
    # The second night became the baseline only if compare passed it.
    assert (history / "last-good.json").read_bytes() == nights[codes[1] == 0].read_bytes()
    assert (history / "nights" / (nights[1].stem + ".compare.txt")).read_text().strip()
    trend = (history / "trend.txt").read_text()
    assert f"| {nights[0].stem} | {nights[1].stem} |" in trend


def test_the_notebooks_tables_are_refreshed_from_their_json(tmp_path, monkeypatch):
    sync = load_sync()
    notebook = tmp_path / "NOTES.md"
    notebook.write_text("<!-- generated: benchmarks/results/cpu-2core-20k-paired-4.json -->\nold\n"
                        "<!-- /generated -->\n")
    monkeypatch.setattr(sync, "NOTEBOOK", str(notebook))
    assert os.path.relpath(notebook, sync.DOCS) in sync.stale_pages()
    assert sync.main([]) == 0 and sync.stale_pages() == []
    assert "| lmdb | 13,090 ±7% |" in notebook.read_text()


def test_the_manual_is_a_manual_and_the_notebook_keeps_the_runs():
    manual = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(manual.splitlines()) <= 300
    assert "<!-- generated: benchmarks/results/cpu-2core-20k.json table -->" in manual
    notes = (RESULTS / "NOTES.md").read_text()
    assert "<!-- generated: benchmarks/results/cpu-2core-20k.json -->" in notes
    assert len(re.findall(r"^## 2026-\d\d-\d\d · ", notes, re.M)) >= 10
