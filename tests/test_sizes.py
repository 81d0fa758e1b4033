"""Size limits on packer/ and readers/, read from the source with ast: no function over 60 lines, no class
over 250 and no module over 650. A piece that large holds more than one concept; the failure names each
one and its size."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("packer", "readers")
MAX_FUNCTION_LINES = 60  # def line to last line, decorators not counted
MAX_MODULE_LINES = 650
MAX_CLASS_LINES = 250  # class line to last line


def functions(node: ast.AST, prefix: str = ""):
    """(qualified name, first line, lines) of every function and method under node, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                yield name, child.lineno, child.end_lineno - child.lineno + 1
            yield from functions(child, name + ".")
        else:
            yield from functions(child, prefix)


def oversized(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    """Each module and function over its limit, as `path: N lines` or `path:line name(): N lines`."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            text, where = path.read_text(), path.relative_to(root).as_posix()
            lines = text.count("\n")
            if lines > MAX_MODULE_LINES:
                found.append(f"{where}: {lines} lines, over the {MAX_MODULE_LINES} a module may have")
            for name, first, size in functions(ast.parse(text, filename=str(path))):
                if size > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{first} {name}(): {size} lines, over the {MAX_FUNCTION_LINES} a "
                                 "function may have")
    return found


def classes(tree: ast.AST):
    """(name, first line, lines) of every class under tree, nested ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def oversized_classes(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    """Each class over MAX_CLASS_LINES, as `path:line Name: N lines`."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            for name, first, size in classes(ast.parse(path.read_text(), filename=str(path))):
                if size > MAX_CLASS_LINES:
                    found.append(f"{where}:{first} {name}: {size} lines, over the {MAX_CLASS_LINES} a class may have")
    return found


def function(header: str, lines: int, indent: str = "") -> str:
    """A function `lines` long, its def line included."""
    return indent + header + "\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))


def padded(text: str, lines: int) -> str:
    return text + "\n" * (lines - text.count("\n"))


def test_each_module_and_function_over_its_limit_is_named_with_its_size(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "fits.py").write_text(padded(function("def at_limit():", 60), 650))
    nested = function("def inner():", 61, "    ").replace("    def inner", "def outer():\n    def inner", 1)
    (tmp_path / "pkg" / "sub" / "big.py").write_text(padded(
        "class Reader:\n" + function("def read(self):", 61, "    ") + "@decorated\n" + nested, 651))
    assert oversized(tmp_path, ["pkg"]) == [
        "pkg/sub/big.py: 651 lines, over the 650 a module may have",
        "pkg/sub/big.py:2 Reader.read(): 61 lines, over the 60 a function may have",
        "pkg/sub/big.py:64 outer(): 62 lines, over the 60 a function may have",
        "pkg/sub/big.py:65 outer.inner(): 61 lines, over the 60 a function may have",
    ]


def test_no_module_or_function_of_packer_or_readers_is_over_its_size_limit():
    found = oversized()
    assert not found, "split these (one concept each):\n" + "\n".join(found)


def test_each_class_over_its_limit_is_named_with_its_size(tmp_path):
    (tmp_path / "pkg").mkdir()
    nested = function("class Outer:", 252).replace("    x0 = 0\n", function("class Inner:", 251, "    "), 1)
    (tmp_path / "pkg" / "big.py").write_text(function("class Big:", 251) + function("class Fits:", 250) + nested)
    assert oversized_classes(tmp_path, ["pkg"]) == [
        "pkg/big.py:1 Big: 251 lines, over the 250 a class may have",
        "pkg/big.py:502 Outer: 502 lines, over the 250 a class may have",
        "pkg/big.py:503 Inner: 251 lines, over the 250 a class may have",
    ]


def test_no_class_of_packer_or_readers_is_over_its_size_limit():
    found = oversized_classes()
    assert not found, "split these (one concept each):\n" + "\n".join(found)
