"""The packer command as users run it: exit codes, messages, refusal, crash safety."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.formats import FORMATS

from conftest import jpeg_bytes, write

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if any(s in p.name for s in (".partial-", ".complete-", ".old-"))]


def test_pack_writes_default_output_and_summary(image_tree):
    result = run("pack", image_tree, "--to", "lmdb", "--workers", "2")
    assert result.exit_code == 0, result.output
    out = Path(str(image_tree) + ".lmdb")
    assert (out / "data.mdb").is_file()
    assert re.search(r"packed 19 images .* files/s, \d+ MB/s", result.stderr)
    assert "file/s" not in result.stderr  # no progress bar when stderr is not a terminal
    assert leftovers(image_tree.parent) == []


def test_info_json_is_one_object_for_scripts(split_tree):
    assert run("pack", split_tree, "--to", "lmdb").exit_code == 0
    result = run("info", str(split_tree) + ".lmdb", "--json")
    assert result.exit_code == 0
    facts = json.loads(result.stdout)
    assert facts["format"] == "lmdb"
    assert facts["count"] == 16 and facts["splits"]["train"]["count"] == 12
    assert facts["classes"] == ["a", "b", "c"]
    assert facts["splits"]["val"]["class_counts"] == [2, 0, 2]
    assert facts["skipped"] == [] and facts["bytes"] > 0
    assert facts["source"] == str(split_tree)
    human = run("info", str(split_tree) + ".lmdb")
    assert "split train: 12 images" in human.stdout


def test_existing_output_is_refused_without_force(image_tree, tmp_path):
    out = tmp_path / "out.lmdb"
    assert run("pack", image_tree, "--to", "lmdb", "-o", out).exit_code == 0
    before = (out / "data.mdb").read_bytes()
    refused = run("pack", image_tree, "--to", "lmdb", "-o", out)
    assert refused.exit_code == 1
    assert "already exists (pass --force" in refused.stderr
    assert (out / "data.mdb").read_bytes() == before
    write(image_tree / "cat" / "new.jpg", jpeg_bytes(99))
    forced = run("pack", image_tree, "--to", "lmdb", "-o", out, "--force")
    assert forced.exit_code == 0
    assert json.loads(run("info", out, "--json").stdout)["count"] == 20
    assert leftovers(tmp_path) == []


def test_bad_file_fails_by_default_naming_it_and_leaves_nothing(bad_tree, tmp_path):
    out = tmp_path / "bad.lmdb"
    result = run("pack", bad_tree, "--to", "lmdb", "-o", out, "--workers", "1")
    assert result.exit_code == 1
    # The first bad file in ImageFolder order is bad/empty.jpg.
    assert "bad/empty.jpg: empty file (0 bytes) (pass --on-error skip" in result.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def test_skip_packs_the_rest_and_records_what_was_skipped(bad_tree, tmp_path):
    out = tmp_path / "bad.lmdb"
    result = run("pack", bad_tree, "--to", "lmdb", "-o", out, "--on-error", "skip")
    assert result.exit_code == 0, result.output
    for name, reason in [("empty.jpg", "empty file"), ("text.jpg", "not an image"),
                         ("truncated.jpg", "truncated JPEG"), ("unreadable.jpg", "cannot read file")]:
        assert re.search(rf"skipped bad/{name}: {reason}", result.stderr), result.stderr
    facts = json.loads(run("info", out, "--json").stdout)
    assert facts["count"] == 3
    assert sorted(s["path"] for s in facts["skipped"]) == [
        "bad/empty.jpg", "bad/text.jpg", "bad/truncated.jpg", "bad/unreadable.jpg"]
    assert facts["splits"]["all"]["class_counts"] == [0, 3]  # the 'bad' class keeps label 0


def test_full_check_is_selectable(bad_tree, tmp_path):
    result = run("pack", bad_tree, "--to", "lmdb", "-o", tmp_path / "o.lmdb", "--check", "full",
                 "--on-error", "skip")
    assert result.exit_code == 0
    assert json.loads(run("info", tmp_path / "o.lmdb", "--json").stdout)["params"]["check"] == "full"


def test_usage_errors_exit_2_and_list_choices(image_tree):
    result = run("pack", image_tree, "--to", "zip")
    assert result.exit_code == 2
    assert "'zip' is not a format" in result.stderr and "lmdb (mdb)" in result.stderr
    assert run("pack", image_tree / "nope", "--to", "lmdb").exit_code == 2


@pytest.mark.skipif(sys.platform == "win32", reason="control characters in folder names are POSIX's")
def test_names_from_a_dataset_are_printed_with_their_control_characters_escaped(tmp_path):
    """A class folder named to retitle the terminal and fake an output line, with a bidi
    override: info and verify print the name escaped, so a terminal shows it, not obeys it."""
    evil = "evil\x1b]0;pwned\x07\nok: fake\u202e"
    src = tmp_path / "src"
    write(src / "plain" / "a.jpg", jpeg_bytes(1))
    write(src / evil / "b.jpg", jpeg_bytes(2))
    out = tmp_path / "d.lmdb"
    assert run("pack", src, "--to", "lmdb", "-o", out).exit_code == 0
    info = run("info", out)
    assert info.exit_code == 0, info.output
    assert "evil\\x1b]0;pwned\\x07\\nok: fake\\u202e" in info.output
    assert not any(c in info.output for c in "\x1b\x07\u202e")
    assert not any(line.startswith("ok: fake") for line in info.output.splitlines())
    write(src / evil / "b.jpg", jpeg_bytes(3))  # now differs from the packed record
    verify = run("verify", out, "--against", src, "--workers", "1")
    assert verify.exit_code == 1
    assert "evil\\x1b]0;pwned\\x07\\nok: fake\\u202e/b.jpg" in verify.stderr
    assert not any(c in verify.stderr for c in "\x1b\x07\u202e")
    as_json = run("info", out, "--json").output
    assert json.loads(as_json)["classes"] == [evil, "plain"]  # scripts get the name
    assert not any(c in as_json for c in "\x1b\x07\u202e") and "fake\\u202e" in as_json  # a terminal shows it
    odd = tmp_path / evil  # an error naming it: one line, escaped
    odd.mkdir()
    error = run("info", odd)
    assert error.exit_code == 1 and "pwned\\x07\\nok: fake" in error.stderr
    assert not any(c in error.stderr for c in "\x1b\x07\u202e") and error.stderr.count("\n") == 1


def test_warnings_printed_while_a_command_runs_are_escaped():
    """Python prints a warning through warnings.formatwarning when it has been replaced."""
    import warnings

    from packer.cli import escaped_warnings
    plain = warnings.formatwarning
    with escaped_warnings():
        text = warnings.formatwarning("shard evil\x1b]0;pwned\x07\nok: fake was skipped", RuntimeWarning,
                                      "wds.py", 7)
    assert "RuntimeWarning: shard evil\\x1b]0;pwned\\x07\\nok: fake was skipped" in text
    assert "\x1b" not in text and "\x07" not in text and text.startswith("wds.py:7: ")
    assert warnings.formatwarning is plain  # put back


WORKERS_WARN = """
import functools, multiprocessing, sys, warnings
from packer.engine import load_in_processes
multiprocessing.set_start_method(sys.argv[1])
warn = functools.partial(warnings.warn, category=RuntimeWarning)
list(load_in_processes([f"shard {i} evil\x1b]0;pwned\x07 was skipped" for i in range(4)], warn, 2, chunk=1))
"""


@pytest.mark.parametrize("start", ["fork", "spawn", "forkserver"])
def test_warnings_printed_by_worker_processes_are_escaped_however_they_start(start):
    """A worker started by spawn or forkserver (Python 3.14's default) does not inherit the
    command's escaping: it escapes its own warnings."""
    done = subprocess.run([sys.executable, "-c", WORKERS_WARN, start], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for i in range(4):
        assert f"RuntimeWarning: shard {i} evil\\x1b]0;pwned\\x07 was skipped" in done.stderr, done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr


def test_info_on_a_non_dataset_names_the_path(tmp_path):
    result = run("info", tmp_path)
    assert result.exit_code == 1
    assert f"{tmp_path}: not a packed dataset" in result.stderr


def slow_source(tmp_path: Path, n: int = 400) -> Path:
    src = tmp_path / "slow"
    for i in range(n):
        write(src / f"c{i % 4}" / f"{i}.jpg", jpeg_bytes(i, size=(320, 240)))
    return src


def start_pack(src: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "packer.cli", "pack", str(src), "--to", "lmdb", "-o", str(out),
                             "--workers", "1", "--check", "full"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)


def wait_for_staging(folder: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not leftovers(folder):
        assert proc.poll() is None, "pack finished before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.005)


def interrupt_pack(tmp_path: Path, sig: int) -> tuple[Path, Path, int, str]:
    """Start a pack, send it sig once its staging folder exists; (src, out, exit code, stderr)."""
    src = slow_source(tmp_path)
    out = tmp_path / "out.lmdb"
    proc = start_pack(src, out)
    wait_for_staging(tmp_path, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    return src, out, proc.returncode, stderr


def test_killed_pack_leaves_nothing_at_out_and_the_next_run_cleans_up(tmp_path):
    src, out, _, _ = interrupt_pack(tmp_path, signal.SIGKILL)
    assert not out.exists()
    assert leftovers(tmp_path), "SIGKILL cannot clean up; the staging folder is expected to remain"
    result = run("pack", src, "--to", "lmdb", "-o", out)
    assert result.exit_code == 0
    assert "left by an interrupted pack" in result.stderr
    assert leftovers(tmp_path) == [] and (out / "data.mdb").exists()


def test_interrupted_pack_removes_its_staging(tmp_path):
    _, out, code, stderr = interrupt_pack(tmp_path, signal.SIGINT)
    state = f"exit {code}, out exists: {out.exists()}, left: {leftovers(tmp_path)}, stderr:\n{stderr}"
    assert code != 0, state
    assert not out.exists() and leftovers(tmp_path) == [], state


def test_every_command_and_option_is_documented_in_the_manual():
    readme = (ROOT / "docs" / "cli.md").read_text()
    for name, command in main.commands.items():
        assert f"packer {name}" in readme, f"docs/cli.md lacks `packer {name}`"
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    assert opt in readme, f"docs/cli.md lacks {opt} of packer {name}"
    for fmt in FORMATS:
        assert f"--to {fmt}" in readme or f"`{fmt}`" in readme


def test_every_option_and_argument_has_a_help_text():
    for name, command in main.commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"packer {name} {param.opts[0]} has no help text"
            else:  # click arguments take no help: the command's text names each
                assert param.human_readable_name in command.help, \
                    f"packer {name}'s help does not say what {param.human_readable_name} is"


def test_the_command_list_shows_each_description_whole():
    listing = CliRunner().invoke(main, ["--help"], terminal_width=80).output
    lines = listing.split("Commands:\n")[1].splitlines()
    assert len(lines) == len(main.commands) and not any("..." in line for line in lines)  # one line each, none cut
    for name, command in main.commands.items():
        assert any(line.split() == [name, *command.short_help.split()] for line in lines), name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_demo_runs_end_to_end(tmp_path, fmt):
    result = run("demo", "--dir", tmp_path, "--images", "45", "--to", fmt)
    assert result.exit_code == 0, result.output
    assert "writing 40 synthetic JPEGs (10 classes of 4)" in result.stderr  # what it writes, not what was asked
    assert "packed 40 images" in result.stderr
    assert "records byte-identical to the source" in result.stderr
    assert re.search(r"FolderDataset\s+\d+ samples/s", result.stdout)
    assert os.path.isdir(tmp_path / "imagenet-demo")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_disk_full_fails_cleanly_naming_the_output(tmp_path, fmt):
    src = slow_source(tmp_path, n=40)
    out = tmp_path / f"full{FORMATS[fmt].extension}"

    def tiny_disk():  # the child can write at most 256 KB per file: a full disk, as far as it sees
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    proc = subprocess.run([sys.executable, "-m", "packer.cli", "pack", str(src), "--to", fmt, "-o", str(out)],
                          cwd=ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=tiny_disk)
    assert proc.returncode == 1, proc.stderr
    assert f"{out}: writing the {fmt} dataset failed" in proc.stderr and "Traceback" not in proc.stderr
    assert "File too large" in proc.stderr and "free some space" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # nothing at OUT, no staging left


def test_pack_json_is_one_object_on_stdout(split_tree, tmp_path):
    out = tmp_path / "j.lmdb"
    result = run("pack", split_tree, "--to", "lmdb", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["path"] == str(out) and facts["count"] == 16 and facts["classes"] == ["a", "b", "c"]
    assert facts["splits"]["val"]["class_counts"] == [2, 0, 2] and facts["seconds"] >= 0
    assert facts["warnings"] == [] and "packed 16 images" in result.stderr


@pytest.mark.parametrize("alias, fmt", [("h5", "hdf5"), ("HDF", "hdf5"), ("webdataset", "wds"), ("tar", "wds")])
def test_the_formats_common_names_are_accepted(image_tree, tmp_path, alias, fmt):
    out = tmp_path / "out"
    result = run("pack", image_tree, "--to", alias, "-o", out, "--workers", "1")
    assert result.exit_code == 0, result.output
    assert FORMATS[fmt].detect(str(out))


def test_an_unknown_format_lists_every_name_accepted(image_tree):
    result = run("pack", image_tree, "--to", "parquet")
    assert result.exit_code == 2
    assert "'parquet' is not a format; choose one of: lmdb (mdb), hdf5 (h5, hdf), wds (webdataset, tar)" in result.stderr
