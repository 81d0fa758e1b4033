"""The README stays a first page and the manual in docs/ stays in step with the code."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

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
