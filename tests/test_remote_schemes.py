"""packer.remote.schemes is the one place that knows what a URL scheme supports: no other remote
module compares scheme names, every scheme packer names has a row, and the manual shows the table."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from packer.remote import parse_url, scheme_of
from packer.remote.errors import SERVER_CODES, failure
from packer.remote.schemes import DEFAULT, LOCAL, SCHEMES, markdown_table, scheme_for

ROOT = Path(__file__).resolve().parents[1]
REMOTE = ROOT / "packer" / "remote"
NAMES = set(SCHEMES) | set(LOCAL)
ROWS = set(SCHEMES)  # "file" is also fsspec's type of an object: a bare "file" is no scheme test
# Where packer names the schemes a reader or writer takes (the CLI's tcp:// rendezvous is no dataset).
MENTIONS = [*sorted(REMOTE.glob("*.py")), *sorted((ROOT / "packer" / "formats").glob("*.py")),
            *sorted((ROOT / "readers").glob("*.py")), ROOT / "docs" / "remote.md"]


def scheme_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of each string that is a scheme name, or a 'name://' prefix tested with
    startswith or a comparison: the special cases the table replaces."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in ROWS:
            found.append((node.lineno, node.value))
        tested = []
        if isinstance(node, ast.Compare):
            tested = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("startswith", "endswith"):
            tested = node.args
        for one in tested:
            for leaf in ast.walk(one):
                if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str) and "://" in leaf.value:
                    found.append((leaf.lineno, leaf.value))
    return sorted(found)


def test_the_check_finds_a_scheme_special_case():
    code = ('if scheme_of(url) in ("s3", "s3a"):\n    pass\n'
            'at = endpoint if url.startswith("s3://") else None\n'
            'print(f"{url}: write to s3://bucket/key")\n')
    assert scheme_literals(ast.parse(code)) == [(1, "s3"), (1, "s3a"), (3, "s3://")]


def test_no_remote_module_but_the_table_compares_a_scheme():
    found = {f"{path.name}:{line}: {text!r}" for path in sorted(REMOTE.glob("*.py")) if path.name != "schemes.py"
             for line, text in scheme_literals(ast.parse(path.read_text(), filename=str(path)))}
    assert not found, f"scheme special cases outside packer/remote/schemes.py: {sorted(found)}"


def test_every_scheme_packer_names_has_a_row():
    named = {match.lower() for path in MENTIONS for match in re.findall(r"\b([a-z][a-z0-9+.-]*)://", path.read_text())}
    named -= {"scheme"}  # the placeholder in "scheme://..."
    assert named, "no scheme found: the scan is broken"
    assert named - NAMES == set(), f"schemes named without a row in packer.remote.schemes: {named - NAMES}"


@pytest.mark.parametrize("url", [*(f"{name}://bucket/key" for name in SCHEMES), "az://container/key",
                                 "S3://bucket/key"])
def test_every_url_the_parser_takes_finds_its_row(url):
    parsed = parse_url(url)
    row = scheme_for(scheme_of(url))
    assert row is SCHEMES.get(parsed.scheme, DEFAULT)
    assert row.ranged_reads, "packer reads every remote dataset by byte ranges"
    assert (row.listing == "") == (not row.writable), "a writer lists the staging prefixes beside OUT"


def test_retried_codes_are_the_tables():
    assert SERVER_CODES == {code for row in (*SCHEMES.values(), DEFAULT) for code in row.retried}


def test_an_alias_gets_its_schemes_advice():
    denied = PermissionError("403 Forbidden")
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    for name in SCHEMES:
        message = str(failure(f"{name}://bucket/key", denied, "reading", options))
        assert ("http://127.0.0.1:9" in message) == SCHEMES[name].names_endpoint, message
        assert ("web server" in message) == (SCHEMES[name].client == "aiohttp"), message


def test_the_manual_shows_the_table():
    page = (ROOT / "docs" / "remote.md").read_text()
    assert markdown_table() in page, "docs/remote.md's scheme table differs from packer.remote.schemes.markdown_table()"
