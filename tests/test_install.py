"""What the install promises: the packer CLI without torch, readers naming the extra it needs,
`python -m packer` as the command's unshadowed name, and type information for checkers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_packer_cli_never_imports_torch():
    proc = run_python("import sys, packer.cli, packer.pack, packer.convert, packer.verify, packer.scan\n"
                      "from packer.cli import main\n"
                      "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    assert proc.returncode == 0, proc.stderr


def test_readers_without_torch_names_the_extra():
    proc = run_python("import sys; sys.modules['torch'] = None\nimport readers")
    assert proc.returncode != 0
    assert "pip install 'packer[readers]'" in proc.stderr


def test_python_dash_m_packer_is_the_same_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "packer", "info", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "not a packed dataset" in proc.stderr
    usage = subprocess.run([sys.executable, "-m", "packer", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 0 and "Usage: python -m packer" in usage.stdout


def test_both_packages_ship_type_information():
    assert (ROOT / "packer" / "py.typed").is_file() and (ROOT / "readers" / "py.typed").is_file()
    assert 'packer = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


def lock_pins() -> dict:
    """lock/test.txt's pins by normalised name: {name: [(version, marker or None)]}."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict = {}
    for line in (ROOT / "lock" / "test.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            req = Requirement(line)
            (version,) = [s.version for s in req.specifier if s.operator == "=="]
            pins.setdefault(canonicalize_name(req.name), []).append((version, req.marker))
    return pins


def test_the_lock_pins_every_requirement_of_the_test_environment_within_its_range():
    # CI's .ci/lock --check re-resolves with uv (network); this is the offline half: every range
    # pyproject.toml states, for the library and every extra, admits the version the lock pins.
    try:
        import tomllib  # novm: tomli below on Python 3.10
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = lock_pins()
    assert "torch" not in pins, "the lock must leave torch to the machine (lock/leave-out.txt)"
    env = {"python_full_version": "3.11.0", "python_version": "3.11", "sys_platform": "linux",
           "platform_machine": "x86_64", "platform_system": "Linux", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}
    extras, requirements, todo = project["optional-dependencies"], list(project["dependencies"]), ["test"]
    while todo:  # the test extra and the extras it names (packer[readers,...])
        for line in extras[todo.pop()]:
            req = Requirement(line)
            if canonicalize_name(req.name) == "packer":
                todo += sorted(req.extras)
            else:
                requirements.append(line)
    checked = 0
    for line in requirements:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        versions = [v for v, marker in pins.get(name, []) if marker is None or marker.evaluate(env)]
        assert versions, f"{req.name} is required by pyproject.toml but not pinned in lock/test.txt: run .ci/lock"
        assert all(req.specifier.contains(v, prereleases=True) for v in versions), \
            f"lock/test.txt pins {req.name}=={versions} outside pyproject.toml's {req.specifier}: run .ci/lock"
        checked += 1
    assert checked >= 20


def test_the_readme_installs_the_test_environment_through_the_lock():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- ci:commands -->", 1)[1].split("```", 2)[1]
    assert 'pip install -c lock/test.txt -e ".[test]"' in block
    assert "pip install torch==2.13.0" in block  # only where no torch is installed: see the lock's note


def test_python_dash_m_packer_works_from_a_folder_holding_a_packer_folder(tmp_path):
    # The clone's parent: its `packer/` folder (the clone, no __init__.py) is a namespace package
    # ahead of the installed packer; `from . import __version__` failed with "unknown location".
    (tmp_path / "packer" / "packer").mkdir(parents=True)
    (tmp_path / "packer" / "README.md").write_text("a clone\n")
    proc = subprocess.run([sys.executable, "-m", "packer", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("packer, version ")


def oldest_python() -> str:
    """The oldest Python pyproject.toml promises: "3.10" from requires-python = ">=3.10"."""
    (line,) = [line for line in (ROOT / "pyproject.toml").read_text().splitlines()
               if line.startswith("requires-python")]
    return line.split(">=", 1)[1].strip().strip('"')


def test_every_module_runs_on_the_oldest_python_promised():
    # vermin reads each module for the language features and standard-library names it needs. It
    # cannot type a method called on a variable (exc.add_note, 3.11): such a call needs a fallback.
    pytest.importorskip("vermin", reason="the Python-version check needs vermin (in the test extra)")
    vermin = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())"]  # it has no __main__
    proc = subprocess.run([*vermin, f"--target={oldest_python()}-", "--violations", "--eval-annotations", "--no-tips",
                           "packer", "readers", "benchmarks", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"code that needs a newer Python than {oldest_python()}:\n{proc.stdout}{proc.stderr}"
