"""The import graph of packer/ and readers/, read from the source with ast: no circle, not even one that
an import inside a function hides (it still ties the modules together, only later)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("packer", "readers")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path, packages) -> dict[str, Path]:
    return {module_name(root, path): path for package in packages for path in sorted((root / package).rglob("*.py"))}


def imported(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    """The project modules one import statement loads: `from M import n` loads M.n where n is a submodule,
    else M."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [name for name in names if name in modules] + ([base] if any(n not in modules for n in names) else [])


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports, at module level or inside a function. A module's parent
    packages, which Python runs first, are left out: they are the package's public face, not its layers."""
    modules = project_modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in imported(node, name, path.name == "__init__.py", modules):
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, to name in a failure."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"{component} is not a circle")


def test_a_circle_closed_inside_a_function_is_found_and_named(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "low.py").write_text("def late():\n    from .high import top\n    return top\n")
    (tmp_path / "pkg" / "high.py").write_text("from . import low\nfrom .low import late as top\n")
    (tmp_path / "pkg" / "alone.py").write_text("import os\nfrom pkg import low\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": set(), "pkg.alone": {"pkg.low"}, "pkg.high": {"pkg.low"}, "pkg.low": {"pkg.high"}}
    assert circles(graph) == [["pkg.high", "pkg.low"]]
    assert one_loop(graph, ["pkg.high", "pkg.low"]) == ["pkg.high", "pkg.low", "pkg.high"]


def test_no_module_of_packer_or_readers_imports_itself_back():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " -> ".join(one_loop(graph, c)) + f" ({len(c)} modules: {', '.join(c)})" for c in found)


def private_imports(root: Path = ROOT, package: str = "readers", of: str = "packer") -> list[str]:
    """Each import in package of a private module of `of` (a name part with a leading underscore,
    as packer.formats._tar), as `path:line module`: readers read packer's formats through their
    public reading API alone."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
                names.append(node.module)
            else:
                continue
            found += [f"{path.relative_to(root).as_posix()}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] == of and any(part.startswith("_") for part in name.split(".")[1:])]
    return found


def test_a_private_import_is_found_in_each_spelling(tmp_path):
    (tmp_path / "reads").mkdir()
    (tmp_path / "reads" / "a.py").write_text("from packer.formats import _tar, wds\nimport packer.formats._io\n"
                                             "def late():\n    from packer.formats._reader import x\n")
    (tmp_path / "reads" / "b.py").write_text("from packer.formats import wds\nfrom . import _own\nimport _thread\n")
    assert private_imports(tmp_path, "reads") == [
        "reads/a.py:1 packer.formats._tar", "reads/a.py:2 packer.formats._io", "reads/a.py:4 packer.formats._reader"]


def test_readers_import_no_private_module_of_packer():
    found = private_imports()
    assert not found, ("readers use packer's public API (docs/formats.md, 'Reading a format'); these import "
                       "private modules:\n" + "\n".join(found))
