"""What the install promises: the packer CLI without torch, readers naming the extra it needs,
`python -m packer` as the command's unshadowed name, and type information for checkers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
