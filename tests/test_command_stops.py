"""Stop signals outside the command's own run: while `packer` still imports (before its
handlers are in place) and after it has printed its result. Real processes, real signals,
sent at several moments after a line the process itself prints."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import jpeg_bytes, write
from packer import pack

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def small_tree(root: Path) -> Path:
    for i in range(6):
        write(root / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(i))
    return root


def signalled_after(marker: str, delay: float, signame: str, args: list, importtime: bool = False):
    """Start the command, wait for a stderr line holding marker, then `delay` s later send
    the signal; (status, stderr lines the command itself wrote)."""
    flags = ["-X", "importtime"] if importtime else []
    proc = subprocess.Popen([sys.executable, *flags, "-m", "packer", *map(str, args)], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if marker in line:
                break
        else:
            pytest.fail(f"the command ended without printing {marker!r}: {seen[-5:]}")
        time.sleep(delay)
        proc.send_signal(getattr(signal, signame))
        rest = proc.stderr.read()
        status = proc.wait(timeout=60)
    finally:
        proc.kill()
    return status, [line for line in rest.splitlines() if not line.startswith("import time:")]


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.25])
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_stop_while_packer_imports_exits_as_the_command_would(tmp_path, signame, delay):
    """packer.errors is among the first modules packer imports: the rest (and the command
    line's parsing) take a few tenths of a second more, with Python's own handlers before."""
    status, lines = signalled_after(" packer.errors\n", delay, signame,
                                    ["pack", small_tree(tmp_path / "src"), "--to", "lmdb", "-o", tmp_path / "o.lmdb"],
                                    importtime=True)
    signum = getattr(signal, signame)
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines), lines
    if status == 0:  # a quiet machine can finish the whole pack first: its result then stands, whole
        assert delay > 0 and any(line.startswith("packed 6 images") for line in lines), lines
        assert (tmp_path / "o.lmdb" / "data.mdb").is_file()
        return
    assert status == 128 + signum, lines
    assert not (tmp_path / "o.lmdb").exists()


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15])
def test_sigterm_after_merge_printed_its_result_leaves_its_status(tmp_path, delay):
    src = small_tree(tmp_path / "src")
    parts = [pack(str(src), "lmdb", str(tmp_path / f"p{i}.lmdb"), part=f"{i}/2", progress=False, workers=1).out
             for i in range(2)]
    out = tmp_path / "out.lmdb"
    status, lines = signalled_after(f"into {out} in ", delay, "SIGTERM", ["merge", *parts, "-o", out])
    assert status == 0, lines
    assert (out / "data.mdb").is_file()
