"""packer.output on real folders: OUT checks, the staged and recoverable swap, leftovers, write errors.

Kills are real SIGKILLs: a child process sends one to itself from a Python audit hook at
the exact rename or removal under test (no seam in packer). Read-only folders are real
read-only tmpfs or bind mounts, made in a private mount namespace (`unshare -m`), since
the tests run as root and root ignores chmod.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer import FORMATS, pack
from packer.cli import main
from packer.errors import OutputExistsError, PackError
from packer.output import check_target, staged
from packer.staging import HOST
from packer.pack import write_dataset

from conftest import jpeg_bytes, snapshot, tree, write

ROOT = Path(__file__).resolve().parents[1]
STAGES = (".partial-", ".complete-", ".old-")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_packer(*args, prefix: tuple = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "packer.cli", *map(str, args)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if any(stage in p.name for stage in STAGES))


def count(path: Path) -> int:
    result = run("info", path, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["count"]


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE,
                          text=True, check=True)
    return int(proc.stdout)


# 1. OUT is never a source, inside one, or holding one; --force replaces only a dataset.

@pytest.mark.parametrize("where", ["src itself", "folder holding src", "inside src", "symlink to src",
                                   "symlink into src"])
def test_pack_refuses_an_out_that_would_destroy_its_source(tmp_path, where):
    src = tree(tmp_path / "photos", 6)
    write(tmp_path / "unrelated.txt", b"keep me")
    (tmp_path / "link").symlink_to(src)
    out = {"src itself": src, "folder holding src": tmp_path, "inside src": src / "x.lmdb",
           "symlink to src": tmp_path / "link", "symlink into src": tmp_path / "link" / "x.lmdb"}[where]
    before = snapshot(tmp_path)
    result = run("pack", src, "--to", "lmdb", "-o", out, "--force")
    assert result.exit_code == 1, result.output
    assert str(src) in result.stderr and "pass -o" in result.stderr and "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == leftovers(src) == []


def test_pack_refuses_an_out_on_a_bind_mount_of_its_source(tmp_path):
    src = tree(tmp_path / "photos", 6)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    before = snapshot(src)
    proc = in_private_mounts(f"mount --bind {src} {mirror}", "pack", src, "--to", "lmdb", "-o", mirror, "--force")
    assert proc.returncode == 1, proc.stderr
    assert "would write over it" in proc.stderr
    assert snapshot(src) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["packed itself", "folder holding packed", "inside packed"])
def test_convert_refuses_an_out_that_would_destroy_packed(tmp_path, where):
    packed = tmp_path / "data" / "d.lmdb"
    packed.parent.mkdir()
    pack(str(tree(tmp_path / "src", 4)), "lmdb", str(packed), workers=1, progress=False)
    out = {"packed itself": packed, "folder holding packed": packed.parent, "inside packed": packed / "x.h5"}[where]
    before = snapshot(tmp_path / "data")
    result = run("convert", packed, "--to", "hdf5", "-o", out, "--force")
    assert result.exit_code == 1, result.output
    assert str(packed) in result.stderr and "pass -o" in result.stderr
    assert snapshot(tmp_path / "data") == before


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_force_refuses_to_replace_what_is_not_a_dataset(tmp_path, fmt):
    src = tree(tmp_path / "src", 4)
    folder = tmp_path / "holiday"
    write(folder / "beach.jpg", jpeg_bytes(1))
    notes = write(tmp_path / "notes.txt", b"not a dataset")
    for out in (folder, notes):
        before = snapshot(tmp_path)
        result = run("pack", src, "--to", fmt, "-o", out, "--force")
        assert result.exit_code == 1, result.output
        assert f"{out} exists and is not a packer dataset" in result.stderr
        assert "remove it yourself" in result.stderr
        assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


def test_force_replaces_a_dataset_of_any_format(tmp_path):
    src = tree(tmp_path / "src", 4)
    out = tmp_path / "out"
    assert run("pack", tree(tmp_path / "other", 3), "--to", "hdf5", "-o", out).exit_code == 0
    result = run("pack", src, "--to", "lmdb", "-o", out, "--force")
    assert result.exit_code == 0, result.output
    assert count(out) == 4 and leftovers(tmp_path) == []


# 2. The --force swap is recoverable: a kill at any step leaves a state the next run settles.

KILL_AT = """
import os, signal, sys
step = sys.argv.pop(1)

def at_step(event, args):
    if event == "os.rename":
        src, dst = str(args[0]), str(args[1])
        here = {"mark": ".partial-" in src and ".complete-" in dst,
                "aside": ".old-" in dst,
                "swap": ".complete-" in src and ".old-" not in dst}[step] if step != "cleanup" else False
    else:
        here = step == "cleanup" and event == "shutil.rmtree" and ".old-" in str(args[0])
    if here:
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(at_step)
from packer.cli import main
main(sys.argv[1:], prog_name="packer")
"""


def pack_killed_at(step: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_AT, step, *map(str, args)], cwd=ROOT,
                          stderr=subprocess.PIPE, text=True, timeout=120)


# step -> (what is at OUT after the kill: None, "old" or "new"; what the next run leaves at OUT)
KILLS = {"mark": ("old", "old"), "aside": ("old", "old"), "swap": (None, "new"), "cleanup": ("new", "new")}


@pytest.mark.parametrize("step", list(KILLS))
def test_force_pack_killed_at_any_step_is_settled_by_the_next_run(tmp_path, step):
    old_src, new_src = tree(tmp_path / "old", 3), tree(tmp_path / "new", 5, seed=50)
    out = tmp_path / "out.lmdb"
    assert run("pack", old_src, "--to", "lmdb", "-o", out).exit_code == 0
    killed = pack_killed_at(step, "pack", new_src, "--to", "lmdb", "-o", out, "--force", "--workers", "1")
    assert killed.returncode == -9, killed.stderr
    left_at_out, settled = KILLS[step]
    if left_at_out is None:  # exactly what a kill between the two renames leaves
        assert not out.exists()
        assert [name.split("-")[0] for name in leftovers(tmp_path)] == ["out.lmdb.complete", "out.lmdb.old"]
    else:
        assert count(out) == {"old": 3, "new": 5}[left_at_out] and leftovers(tmp_path)
    refused = run("pack", old_src, "--to", "lmdb", "-o", out)  # no --force: settles, then refuses
    assert refused.exit_code == 1 and "already exists" in refused.stderr
    if left_at_out is None:
        assert "finished replacing" in refused.stderr and "left by an interrupted pack" in refused.stderr
    assert count(out) == {"old": 3, "new": 5}[settled]
    assert leftovers(tmp_path) == []


def test_rerun_after_a_kill_between_the_renames_reports_and_replaces(tmp_path):
    src = tree(tmp_path / "src", 4)
    out = tmp_path / "out.wds"
    assert run("pack", tree(tmp_path / "old", 2), "--to", "wds", "-o", out).exit_code == 0
    assert pack_killed_at("swap", "pack", src, "--to", "wds", "-o", out, "--force").returncode == -9
    assert not out.exists()
    again = run("pack", src, "--to", "wds", "-o", out, "--force")
    assert again.exit_code == 0, again.output
    assert "warning: finished replacing" in again.stderr
    assert re.search(r"removed \S+\.old-\S+, left by an interrupted pack", again.stderr)
    assert count(out) == 4 and leftovers(tmp_path) == []


@pytest.mark.parametrize("step", ["mark", "swap"])
def test_file_dataset_is_replaced_in_one_rename(tmp_path, step):
    out = tmp_path / "out.h5"
    assert run("pack", tree(tmp_path / "old", 3), "--to", "hdf5", "-o", out).exit_code == 0
    killed = pack_killed_at(step, "pack", tree(tmp_path / "new", 5), "--to", "hdf5", "-o", out, "--force")
    assert killed.returncode == -9
    assert count(out) == 3  # a file over a file: OUT is never missing, not even for a moment
    assert run("pack", tmp_path / "new", "--to", "hdf5", "-o", out).exit_code == 1
    assert leftovers(tmp_path) == []


def make_dataset(path: Path, n: int, seed: int, fmt: str = "lmdb") -> Path:
    pack(str(tree(path.parent / "sources" / f"{n}-{seed}", n, seed)), fmt, str(path), workers=1, progress=False)
    return path


def test_older_versions_swap_leftovers_are_finished(tmp_path):
    """What a kill between the renames of packer before this change left: OUT missing,
    OUT.old-<pid> (the old dataset) and OUT.partial-<pid> (the complete new one)."""
    out = tmp_path / "out.lmdb"
    pid = dead_pid()
    make_dataset(tmp_path / f"out.lmdb.old-{pid}", 3, 0)
    make_dataset(tmp_path / f"out.lmdb.partial-{pid}", 5, 50)
    result = run("pack", tree(tmp_path / "src", 7), "--to", "lmdb", "-o", out)
    assert result.exit_code == 1 and "already exists" in result.stderr, result.output
    assert count(out) == 5
    assert not (tmp_path / f"out.lmdb.old-{pid}").exists() and leftovers(tmp_path) == []


def test_a_users_own_old_folder_beside_out_is_not_a_leftover(tmp_path):
    backup = make_dataset(tmp_path / f"out.lmdb.old-{dead_pid()}", 3, 0)  # a name older packers also used
    before = snapshot(backup)
    result = run("pack", tree(tmp_path / "src", 4), "--to", "lmdb", "-o", tmp_path / "out.lmdb")
    assert result.exit_code == 0, result.output
    assert snapshot(backup) == before and count(tmp_path / "out.lmdb") == 4


def test_missing_out_is_restored_from_a_dead_writers_old_dataset(tmp_path):
    out = tmp_path / "out.lmdb"
    make_dataset(tmp_path / f"out.lmdb.old-{HOST}-{dead_pid()}-{'0' * 16}", 3, 0)
    tidied = pytest.raises(OutputExistsError, check_target, str(out), [], False)
    assert "restored" in str(tidied.value)
    assert count(out) == 3 and leftovers(tmp_path) == []


def test_an_unfinished_staging_never_becomes_out(tmp_path):
    out = tmp_path / "out.lmdb"
    make_dataset(tmp_path / f"out.lmdb.partial-{HOST}-{dead_pid()}-{'0' * 16}", 5, 50)  # a staging: maybe incomplete
    tidied = check_target(str(out), [], False)
    assert not out.exists() and len(tidied.removed) == 1 and leftovers(tmp_path) == []


def test_a_lone_folder_named_as_older_packers_staging_is_named_never_removed(tmp_path):
    """`OUT.partial-<pid>` alone (no `OUT.old-<pid>` beside it) could be a user's folder."""
    mine = write(tmp_path / f"notes.h5.partial-{dead_pid()}" / "README", b"precious")
    result = run("pack", tree(tmp_path / "src", 4), "--to", "hdf5", "-o", tmp_path / "notes.h5")
    assert result.exit_code == 0, result.output
    assert mine.read_bytes() == b"precious" and "removed" not in result.stderr
    assert f"left {mine.parent} alone: older packers named their staging so, but it may be yours" in result.stderr


@pytest.mark.parametrize("name", ["y.lmdb.partial-{pid}", "y.lmdb.partial-{host}-{pid}-0123456789abcdef"])
def test_a_source_named_like_a_leftover_of_out_is_never_touched(tmp_path, name):
    src = tree(tmp_path / name.format(host=HOST, pid=dead_pid()), 4)
    before = snapshot(src)
    make_dataset(tmp_path / f"y.lmdb.old-{HOST}-{dead_pid()}-{'1' * 16}", 3, 0)  # a swap half done: OUT is restored
    result = run("pack", src, "--to", "lmdb", "-o", tmp_path / "y.lmdb", "--force")
    assert result.exit_code == 0, result.output
    assert snapshot(src) == before and count(tmp_path / "y.lmdb") == 4
    assert f"left {src} alone: it is named like a leftover of a pack to" in result.stderr


# 3. Staging is keyed by host, pid and token; only a provably dead owner's is removed.

def test_staging_name_carries_host_pid_and_a_token(tmp_path):
    out = tmp_path / "out.lmdb"
    with pytest.raises(RuntimeError):
        with staged(str(out), False, True) as stage:
            assert re.fullmatch(rf"out\.lmdb\.partial-{re.escape(HOST)}-{os.getpid()}-[0-9a-f]{{16}}",
                                os.path.basename(stage))
            assert os.path.isdir(stage)
            raise RuntimeError("stop")
    assert leftovers(tmp_path) == []


def test_staging_of_another_host_is_left_alone_with_a_warning(tmp_path):
    src = tree(tmp_path / "src", 4)
    theirs = write(tmp_path / f"out.lmdb.partial-gpu-node-07.cluster-{dead_pid()}-{'ab' * 8}" / "data.mdb", b"x")
    result = run("pack", src, "--to", "lmdb", "-o", tmp_path / "out.lmdb")
    assert result.exit_code == 0, result.output
    assert theirs.read_bytes() == b"x"
    assert f"warning: left {theirs.parent} alone: it belongs to a pack on host gpu-node-07.cluster" in result.stderr
    assert f"rm -rf '{theirs.parent}'" in result.stderr and "removed" not in result.stderr


def test_staging_of_a_live_process_here_is_left_alone(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        live = write(tmp_path / f"out.lmdb.partial-{HOST}-{sleeper.pid}-{'cd' * 8}" / "data.mdb", b"x")
        legacy = write(tmp_path / f"out.lmdb.partial-{sleeper.pid}" / "data.mdb", b"y")
        result = run("pack", tree(tmp_path / "src", 4), "--to", "lmdb", "-o", tmp_path / "out.lmdb")
        assert result.exit_code == 0, result.output
        assert live.read_bytes() == b"x" and legacy.read_bytes() == b"y" and "removed" not in result.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def other_pid_namespace_unavailable() -> str | None:
    if not shutil.which("unshare"):
        return "unshare is not installed"
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], stderr=subprocess.PIPE, text=True)
    return None if proc.returncode == 0 else f"cannot start a PID namespace: {proc.stderr.strip()}"


def test_a_live_staging_from_another_pid_namespace_is_left_alone(tmp_path):
    """Containers sharing a host name (host networking) do not see each other's pids: a live
    pack's staging made in another PID namespace must not look dead from this one."""
    reason = other_pid_namespace_unavailable()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    out = tmp_path / "out.lmdb"
    holder = ("import sys, time; from packer.staging import HOST, PARTIAL, new_owner; "
              "stage = new_owner().path(sys.argv[1], PARTIAL); open(stage, 'wb').close(); "
              "print(HOST, stage, flush=True); time.sleep(60)")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                             sys.executable, "-c", holder, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        theirs, stage = proc.stdout.readline().split()
        assert theirs != HOST and ".pidns" in theirs  # pid 1 of its namespace: alive there, not here
        result = run("pack", tree(tmp_path / "src", 4), "--to", "lmdb", "-o", out)
        assert result.exit_code == 0, result.output
        assert os.path.exists(stage) and "removed" not in result.stderr
        assert f"left {stage} alone: it belongs to a pack on host {theirs}" in result.stderr
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("name", ["out.lmdb.partial-{host}-{pid}-0123456789abcdef",
                                  "out.lmdb.complete-{host}-{pid}-0123456789abcdef"])
def test_staging_of_a_dead_process_here_is_removed(tmp_path, name):
    make_dataset(tmp_path / "out.lmdb", 3, 0)  # so a complete one is rolled back, not moved in
    stale = write(tmp_path / name.format(host=HOST, pid=dead_pid()) / "data.mdb", b"x").parent
    result = run("pack", tree(tmp_path / "src", 4), "--to", "lmdb", "-o", tmp_path / "out.lmdb", "--force")
    assert result.exit_code == 0, result.output
    assert f"removed {stale}, left by an interrupted pack" in result.stderr
    assert leftovers(tmp_path) == [] and count(tmp_path / "out.lmdb") == 4


# 12, 13. Write errors say what they are: no space, not writable, or what the system said.

def private_mounts_available() -> str | None:
    if not shutil.which("unshare"):
        return "unshare is not installed"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt"], stderr=subprocess.PIPE,
                          text=True)
    return None if proc.returncode == 0 else f"cannot mount in a private namespace: {proc.stderr.strip()}"


def in_private_mounts(setup: str, *args) -> subprocess.CompletedProcess:
    """Run `packer ARGS` after the shell commands setup, in a mount namespace of its own."""
    reason = private_mounts_available()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    script = f'{setup} && exec "$@"'
    return run_packer(*args, prefix=("unshare", "-m", "sh", "-c", script, "sh"))


def read_only(folder: Path) -> str:
    return f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pack_into_a_read_only_folder_says_it_is_not_writable(tmp_path, fmt):
    src = tree(tmp_path / "src", 4)
    folder = tmp_path / "ro"
    folder.mkdir()
    proc = in_private_mounts(f"mount -t tmpfs -o ro none {folder}", "pack", src, "--to", fmt, "-o", folder / "out")
    assert proc.returncode == 1, proc.stderr
    assert f"{folder / 'out'}: OUT is not writable" in proc.stderr and "Read-only file system" in proc.stderr
    assert "free some space" not in proc.stderr and "Traceback" not in proc.stderr


def test_force_into_a_read_only_folder_keeps_the_old_dataset(tmp_path):
    src = tree(tmp_path / "src", 4)
    folder = tmp_path / "ro"
    out = make_dataset(folder / "out.lmdb", 3, 0)
    before = snapshot(folder)
    proc = in_private_mounts(read_only(folder), "pack", src, "--to", "lmdb", "-o", out, "--force")
    assert proc.returncode == 1, proc.stderr
    assert "OUT is not writable" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(folder) == before and count(out) == 3


def test_convert_into_a_read_only_folder_says_it_is_not_writable(tmp_path):
    packed = make_dataset(tmp_path / "d.lmdb", 3, 0)
    folder = tmp_path / "ro"
    folder.mkdir()
    proc = in_private_mounts(read_only(folder), "convert", packed, "--to", "wds", "-o", folder / "d.wds")
    assert proc.returncode == 1, proc.stderr
    assert "OUT is not writable" in proc.stderr and "Traceback" not in proc.stderr
    assert list(folder.iterdir()) == []


def test_library_os_errors_reach_the_cli_as_a_message_naming_the_path(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    proc = in_private_mounts(read_only(folder), "demo", "--dir", folder, "--images", "10")
    assert proc.returncode == 1, proc.stderr
    assert f"{folder}" in proc.stderr and "Read-only file system" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_out_in_a_missing_folder_is_refused_naming_it(tmp_path, fmt):
    src = tree(tmp_path / "src", 4)
    for folder, what in [(tmp_path / "no" / "such", "does not exist"),
                         (write(tmp_path / "file", b"x"), "is not a folder")]:
        result = run("pack", src, "--to", fmt, "-o", folder / "out")
        assert result.exit_code == 1, result.output
        assert f"{folder}: the folder to write OUT {folder / 'out'} in {what}" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "src"]


def test_a_name_too_long_is_not_called_a_full_disk(tmp_path):
    out = tmp_path / ("x" * 240 + ".h5")
    result = run("pack", tree(tmp_path / "src", 4), "--to", "hdf5", "-o", out)
    assert result.exit_code == 1, result.output
    assert "File name too long" in result.stderr and "free some space" not in result.stderr
    assert leftovers(tmp_path) == []


def test_a_bug_while_writing_stays_a_bug(tmp_path):
    out = tmp_path / "out.lmdb"

    def broken_fill(writer):
        return writer.no_such_method()

    with pytest.raises(AttributeError, match="no_such_method"):
        write_dataset("lmdb", str(out), False, None, broken_fill)
    assert not out.exists() and leftovers(tmp_path) == []


def test_an_os_error_that_is_not_about_space_says_what_it_is(tmp_path):
    out = tmp_path / "out.lmdb"

    def unreadable_input(writer):
        open(tmp_path / "gone.jpg", "rb")

    with pytest.raises(PackError) as raised:
        write_dataset("lmdb", str(out), False, None, unreadable_input)
    assert "No such file or directory" in str(raised.value) and str(tmp_path / "gone.jpg") in str(raised.value)
    assert "free some space" not in str(raised.value)
    assert not out.exists() and leftovers(tmp_path) == []
