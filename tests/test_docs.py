"""The README stays a first page and the manual in docs/ stays in step with the code."""
from __future__ import annotations

import ast
import json
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_sync():
    spec = importlib.util.spec_from_file_location("docs_sync", ROOT / "docs" / "sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_blocks_match_their_sources():
    assert load_sync().stale_pages() == [], "run `python docs/sync.py`"


def test_a_stale_block_is_found(tmp_path, monkeypatch):
    sync = load_sync()
    page = tmp_path / "page.md"
    page.write_text("<!-- generated: packer/formats/lmdb.py -->\nold text\n<!-- /generated -->\n")
    monkeypatch.setattr(sync, "DOCS", str(tmp_path))
    assert sync.stale_pages() == ["page.md"]
    assert sync.main([]) == 0 and sync.stale_pages() == []
    assert "Keys are ASCII" in page.read_text()


def test_readme_is_a_short_first_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "<!-- ci:commands -->" in readme


def test_every_link_to_docs_resolves():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_the_module_map_lists_every_module():
    mapping = (ROOT / "docs" / "layout.md").read_text()
    for package in ["packer", "packer/formats", "readers", "benchmarks", "benchmarks/suites"]:
        for module in sorted((ROOT / package).glob("*.py")):
            assert re.search(rf"(^|\s){re.escape(module.name)}(\s|$|:)", mapping), \
                f"docs/layout.md's module map lacks {package}/{module.name}"


def section(page: str, heading: str) -> str:
    """The text of page's section under heading, up to the next heading of any level."""
    text = (ROOT / "docs" / page).read_text()
    return re.split(r"\n#+ ", text.split(f"\n{heading}\n", 1)[1], maxsplit=1)[0]


def test_the_cuda_prefetchers_documented_signature_is_its_own():
    pytest.importorskip("torch")
    from readers import CUDAPrefetcher

    documented = re.search(r"`CUDAPrefetcher\((.*)\)`", section("readers.md", "### `readers.CUDAPrefetcher`")).group(1)
    assert [part.split("=")[0] for part in documented.split(", ")] == list(inspect.signature(CUDAPrefetcher).parameters)


def test_the_default_worker_count_documented_is_the_one_counted():
    # readers.md's make_loader table names what default_workers calls: affinity capped by the cgroup quota.
    source = (ROOT / "readers" / "loader.py").read_text()
    counted = re.search(r"def default_workers\(\).*?return ([^\n]*)", source, re.S).group(1)
    assert "available_cores()" in counted and "local_world_size()" in counted
    (row,) = [line for line in (ROOT / "docs" / "readers.md").read_text().splitlines()
              if line.startswith("| `workers` |")]
    assert "sched_getaffinity" in row and "cgroup CPU quota" in row and "LOCAL_WORLD_SIZE" in row


def test_adding_a_format_names_every_file_a_test_requires_of_it():
    # test_the_module_map_lists_every_module above holds every format module to a line in layout.md.
    assert "layout.md" in section("formats.md", "## Adding a format")
    layout = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    assert "docs/layout.md" in layout.split("A\nformat is", 1)[1].split(";", 1)[0]


def test_only_demo_and_doctor_reach_torch_and_only_inside_a_function():
    # The README's Layout: packer runs without torch; demo and doctor call up into readers, lazily.
    reaching = {}
    for path in sorted((ROOT / "packer").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(name.split(".")[0] in ("torch", "readers", "torchvision") for name in names):
                assert id(node) not in top_level, f"{path.name}:{node.lineno} imports torch at module level"
                reaching.setdefault(path.relative_to(ROOT).as_posix(), []).append(node.lineno)
    assert sorted(reaching) == ["packer/demo.py", "packer/doctor.py"], reaching


def test_the_readme_states_a_suite_time_within_the_one_target():
    from benchmarks.suitetime import TARGET_SECONDS

    readme = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(r"no GPU needed; about (\d+) minutes on 2 quiet cores, (within|over) the (\d+)-minute target "
                       r"that `python -m benchmarks suite-time` measures", readme)
    assert stated, "the README's set-up section states the suite's measured time and its target"
    assert int(stated.group(3)) * 60 == TARGET_SECONDS
    assert (int(stated.group(1)) * 60 <= TARGET_SECONDS) == (stated.group(2) == "within")


# --- docs by kind: guides and references hold no measurements; the results pages do ------

# A dated run's marks: its date, or the load or quiet of the machine it ran on.
RUN_MARKS = re.compile(r"\b20\d\d-\d\d-\d\d\b|load average (about|of) \d|\bload (about )?\d|quiet machine|quiet \d-core|"
                       r"shared with other jobs|shared \d-core machine|\bone run on\b", re.I)
FIGURE = re.compile(r"[~≈]?\d[\d,.]*( ?[-–] ?[\d,.]+)?( ?[a-zA-Z/%µ]+)?( \(.*\))?( ±\d+%)?")
# The benchmark manual's tables are generated from the committed results, each under its run's date.
NOT_GUIDES = {"benchmarks.md"}
STUDIES = ROOT / "benchmarks" / "results" / "STUDIES.md"


def prose(text: str) -> list[tuple[int, str]]:
    """The numbered lines of a page outside code fences and generated blocks."""
    found, fenced, generated = [], False, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("<!-- generated:") or line.startswith("<!-- /generated"):
            generated = line.startswith("<!-- generated:")
        elif not fenced and not generated:
            found.append((number, line))
    return found


def measured_row(line: str) -> bool:
    """A table row whose cells past the first are mostly figures, two at least: a table of measurements."""
    if not line.startswith("|") or set(line) <= set("|-: "):
        return False
    cells = [cell.strip() for cell in line.strip().strip("|").split("|")][1:]
    figures = [cell for cell in cells if FIGURE.fullmatch(cell)]
    return len(figures) >= 2 and 2 * len(figures) >= len(cells)


def measurements(text: str) -> list[str]:
    return [f"{number}: {line}" for number, line in prose(text) if RUN_MARKS.search(line) or measured_row(line)]


def test_guides_hold_no_dated_runs_and_no_tables_of_measured_figures():
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name not in NOT_GUIDES:
            found = measurements(page.read_text())
            assert not found, (f"docs/{page.name} holds measurements: put them in a study file "
                               "(benchmarks/studies.py) rendered in benchmarks/results/STUDIES.md, and link there:\n"
                               + "\n".join(found))


def test_a_dated_run_and_a_table_of_figures_are_found():
    page = ("Two runs on a shared 2-core machine (load average about 15: rough figures):\n\n"
            "| source | random | block |\n| --- | --- | --- |\n| local files | 3,800-4,100 | 920-3,500 (77-295) |\n\n"
            "| limit | value |\n|---|---|\n| ranks | 65,536 |\n```\nload 9 in a fence\n```\n")
    assert [line.split(":")[0] for line in measurements(page)] == ["1", "5"]


def test_every_study_is_rendered_on_the_results_page_and_names_its_guide():
    from benchmarks import studies

    page = STUDIES.read_text()
    files = sorted((ROOT / "benchmarks" / "results").glob("study-*.json"))
    assert files
    for path in files:
        study = json.loads(path.read_text())
        assert path.name == f"study-{study['study']}.json"
        assert f"<!-- generated: benchmarks/results/{path.name} -->" in page, f"STUDIES.md lacks {path.name}"
        assert (ROOT / "docs" / study["guide"]).exists() and "](../benchmarks/results/STUDIES.md#" in \
            (ROOT / "docs" / study["guide"]).read_text(), f"docs/{study['guide']} does not link to its results"
        assert study["date"] in studies.markdown(study)


@pytest.mark.parametrize("change, says", [
    (lambda s: s.pop("machine"), "needs machine"),
    (lambda s: s.update(date="last week"), "not YYYY-MM-DD"),
    (lambda s: s["blocks"].append({"chart": "x"}), "one of text, table or command"),
    (lambda s: s["blocks"].append({"table": {"head": ["a", "b"], "rows": [["1"]]}}), "its head's 2 cells"),
])
def test_a_study_that_does_not_say_what_produced_it_is_refused(change, says):
    from benchmarks import studies

    study = json.loads((ROOT / "benchmarks" / "results" / "study-parts-figures.json").read_text())
    change(study)
    with pytest.raises(ValueError, match=says):
        studies.markdown(study)
