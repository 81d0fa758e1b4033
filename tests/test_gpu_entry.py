"""`python -m benchmarks gpu` on the CPU: the results folder, failures recorded, the time budget,
and `gpu prepare`'s pieces (wheel needs, git's exclude file, the carried layout)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch

from benchmarks import cache, gpu, transfer
from benchmarks.__main__ import main as bench_main

def bench_gpu(*args: str) -> subprocess.CompletedProcess:
    """`python -m benchmarks gpu ARGS`, in this process (its own steps start their subprocesses)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = bench_main(["gpu", *args])
        except SystemExit as exc:  # argparse refusing the arguments
            code = exc.code
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


def results(out) -> dict:
    return json.loads((out / "gpu-results.json").read_text())


def test_a_cpu_run_fills_one_flat_folder_and_skips_the_cuda_only_step(tmp_path):
    passing_test = tmp_path / "test_passes.py"  # outside tests/: no conftest to load, so seconds
    passing_test.write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "out"
    proc = bench_gpu("--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "tests,corpus,nvjpeg",
                     "--images", "20", "--synthetic", "--quick", "--device", "cpu", "--tests", str(passing_test))
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["gpu-results.json", "gpu.log", "summary.md", "tests.xml"]  # flat, well under 8 files
    steps = results(out)["steps"]
    assert list(steps) == ["env", "tests", "corpus", "nvjpeg"]
    assert steps["env"]["status"] == "ok" and steps["env"]["packages"]["lmdb"]
    assert steps["tests"]["status"] == "ok" and (steps["tests"]["tests"], steps["tests"]["failures"]) == (1, 0)
    assert steps["corpus"]["status"] == "ok" and steps["corpus"]["images"] == 20
    assert os.path.isdir(steps["corpus"]["lmdb"]) or os.path.isfile(steps["corpus"]["lmdb"])
    assert steps["nvjpeg"] == {"status": "skipped", "reason": "no CUDA"}
    assert all(steps[name]["seconds"] >= 0 for name in ("env", "tests", "corpus"))  # each step timed
    summary = (out / "summary.md").read_text()
    assert "| nvjpeg | skipped |" in summary and "| tests | ok |" in summary
    assert "--- corpus" in (out / "gpu.log").read_text()


def test_a_failed_step_is_recorded_and_the_next_steps_still_run(tmp_path):
    failing_test = tmp_path / "test_fails.py"
    failing_test.write_text("def test_fails():\n    assert 1 == 2\n")
    broken_tool = tmp_path / "make_corpus.py"
    broken_tool.write_text("import sys\nsys.exit(3)\n")
    out = tmp_path / "out"
    proc = bench_gpu("--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "tests,feed",
                     "--images", "20", "--quick", "--device", "cpu", "--corpus-tool", str(broken_tool),
                     "--tests", str(failing_test))
    assert proc.returncode == 1
    steps = results(out)["steps"]
    assert steps["tests"]["status"] == "error" and steps["tests"]["failed"] == ["test_fails::test_fails"]
    assert steps["corpus"]["status"] == "error" and "make_corpus.py exited 3" in steps["corpus"]["error"]
    assert steps["feed"] == {"status": "skipped", "reason": "no corpus (the corpus step failed or was skipped)"}
    assert "FAILED: tests, corpus" in proc.stderr


def test_steps_that_cannot_fit_the_time_budget_are_skipped_saying_so(tmp_path):
    out = tmp_path / "out"
    proc = bench_gpu("--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "tests,scaling",
                     "--time-budget", "25", "--quick", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = results(out)["steps"]
    for name in ("tests", "corpus", "scaling"):
        assert steps[name]["status"] == "skipped" and "of --time-budget 25" in steps[name]["reason"]


def test_unknown_steps_and_a_missing_out_are_refused(tmp_path):
    proc = bench_gpu("--steps", "tests,gpu-magic", "--out", str(tmp_path))
    assert proc.returncode == 2 and "unknown step(s) gpu-magic" in proc.stderr
    proc = bench_gpu("--steps", "tests")
    assert proc.returncode == 2 and "--out DIR is required" in proc.stderr


def test_utilisation_without_cuda_says_why():
    from benchmarks.suites.feed import Utilisation

    util = Utilisation(torch.device("cpu")).start()
    assert util.stop() == {"gpu_util": None, "reason": "no CUDA device"}


def test_the_suite_size_fits_the_time_left():
    estimates = [gpu.suite_seconds(p) for p in gpu.SUITE_PRESETS.values()]
    assert estimates == sorted(estimates, reverse=True)  # presets run largest first
    assert all(e > 0 for e in estimates)


def test_auto_sizes_the_suite_and_never_picks_a_preset_run_only_by_name():
    seconds = {name: gpu.suite_seconds(p) for name, p in gpu.SUITE_PRESETS.items()}
    assert gpu.sized_preset(seconds["full"] / 0.8) == "full"
    assert gpu.sized_preset(seconds["standard"] / 0.8) == "standard"
    assert seconds["small"] < seconds["defaults"] < seconds["standard"]
    assert gpu.sized_preset(seconds["defaults"] / 0.8) == "small"  # defaults fits, but is run only by name
    assert gpu.sized_preset(1.0) == "minimal"


def make_wheel(path, requires: list[str]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: pkg\n" +
                   "".join(f"Requires-Dist: {r}\n" for r in requires))
    return str(path)


def test_wheel_requirements_leave_extras_out(tmp_path):
    wheel = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl",
                       ["numpy>=1.19", "PyYAML", "Brace_Expand ; python_version >= '3'", "pytest ; extra == 'test'"])
    assert transfer.wheel_requirements(wheel) == ["numpy", "pyyaml", "brace-expand"]


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "tracked.txt").write_bytes(b"x" * 1000)
    subprocess.run(["git", "-C", str(root), "add", "tracked.txt"], check=True)
    return root


def test_git_exclude_adds_each_pattern_once(repo):
    path = transfer.git_exclude(str(repo), ["/.whl/", "/.carry/"])
    transfer.git_exclude(str(repo), ["/.whl/", "/.carry/"])
    lines = open(path).read().splitlines()
    assert lines.count("/.whl/") == 1 and lines.count("/.carry/") == 1
    (repo / ".whl").mkdir()
    (repo / ".whl" / "a.whl").write_bytes(b"y" * 500)
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert ".whl" not in status.stdout  # ignored, so only `carry` makes it travel
    assert transfer.travelling_bytes(str(repo), [".whl"]) == 1500


def test_prepare_carries_the_photos_and_tool_and_prints_the_run_calls(repo, tmp_path, capsys):
    shared = tmp_path / "shared" / "data"
    (shared / "imagenet-sample" / "n0").mkdir(parents=True)
    (shared / "imagenet-sample" / "n0" / "a.JPEG").write_bytes(b"\xff\xd8\xff")
    (tmp_path / "shared" / "tools").mkdir()
    (tmp_path / "shared" / "tools" / "make_corpus.py").write_text("print('tool')\n")
    parser = gpu.argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(["prepare", "--root", str(repo), "--shared", str(shared), "--no-download"])
    assert gpu.main(args, []) == 0
    carry = repo / ".carry"
    assert (carry / "data" / "imagenet-sample" / "n0" / "a.JPEG").read_bytes() == b"\xff\xd8\xff"
    assert (carry / "tools" / "make_corpus.py").exists()  # ../data/imagenet-sample, as the tool expects
    calls = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(calls) == 1 and calls[0]["timeout_s"] <= 540
    for call in calls:
        assert call["carry"] == [".whl", ".carry"] and len(call["command"]) <= 2000
        assert call["command"].startswith("python3 -m pip install") and "--out $OUT" in call["command"]


def test_the_one_device_command_fits_nine_minutes_and_measures_every_open_item():
    """Issue 40: one prepared command of at most 540 s, setup included, measuring GPU decode and
    the hybrid split (nvjpeg), scaling, pack against tar cf, the feed at the frontier, and 16
    thread workers against 16 worker processes."""
    (command,) = transfer.COMMANDS
    assert command.startswith(transfer.SETUP)
    argv = command[len(transfer.SETUP):].split()
    assert argv[:4] == ["python3", "-m", "benchmarks", "gpu"]
    parser = gpu.argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args([a.replace("$OUT", "/out") for a in argv[4:]])
    assert args.time_budget + 25 <= 540  # the wheels' install and start-up take well under 25 s
    assert {"nvjpeg", "scaling", "pack", "feed", "threads"} <= set(args.steps)
    assert args.feed_model == "resnet18" and "make_loader_hybrid" in args.feed_cases
    assert all(gpu.MIN_SECONDS[s] for s in args.steps)


@pytest.mark.skipif(not cache.CAN_EVICT, reason="needs posix_fadvise to evict")
def test_the_pack_step_times_pack_against_tar_and_writes_its_profile(tmp_path):
    out = tmp_path / "out"
    proc = bench_gpu("--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "pack",
                     "--images", "20", "--synthetic", "--quick", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = results(out)["steps"]
    assert list(steps) == ["env", "corpus", "pack"] and steps["pack"]["status"] == "ok"
    runs = steps["pack"]["runs"]
    assert runs["tar"]["median"] > 0
    for fmt in ("lmdb", "wds"):
        assert runs[fmt]["vs_tar"] == runs[fmt]["seconds"] / runs["tar"]["median"]
        assert runs[fmt]["process_cpu_s"] > 0 and runs[fmt]["top_own_time"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.json", "gpu.log", "pack-profile.txt", "summary.md"]
    assert "== pack lmdb" in (out / "pack-profile.txt").read_text() and "## pack" in (out / "summary.md").read_text()
    assert not os.path.exists(tmp_path / "work" / "pack" / "pack.lmdb")  # outputs removed


def test_the_feed_step_takes_the_frontier_s_model_and_cases_and_skips_gpu_decode_without_cuda(tmp_path):
    refused = bench_gpu("--out", str(tmp_path / "o"), "--feed-cases", "make_loader,hybrid", "--device", "cpu")
    assert refused.returncode == 2 and "--feed-cases: unknown hybrid; cases: defaults" in refused.stderr
    out = tmp_path / "out"
    proc = bench_gpu("--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "feed", "--images", "20",
                     "--synthetic", "--quick", "--device", "cpu", "--feed-model", "resnet18", "--feed-size", "64",
                     "--feed-cases", "make_loader,make_loader_hybrid")
    assert proc.returncode == 0, proc.stderr[-3000:]
    feed = results(out)["steps"]["feed"]
    assert feed["config"]["model"] == "resnet18" and feed["env"]["size"] == 64
    made, hybrid = feed["results"]
    assert made["case"] == "make_loader" and made["steps_timed"] > 0
    assert hybrid == {"case": "make_loader_hybrid", "skipped": "gpu_decode needs CUDA"}


def test_prepare_without_the_shared_photos_says_where_it_looked(repo, tmp_path, capsys):
    parser = gpu.argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(["prepare", "--root", str(repo), "--shared", str(tmp_path / "nowhere")])
    assert gpu.main(args, []) == 2
    assert "imagenet-sample is missing" in capsys.readouterr().err
    assert not (repo / ".carry").exists()


@pytest.mark.skipif(not cache.CAN_EVICT, reason="needs posix_fadvise to evict")
def test_the_disk_step_records_the_curve_without_adding_files(tmp_path):
    out = tmp_path / "out"
    proc = bench_gpu("--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "disk",
                     "--images", "20", "--synthetic", "--quick", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = results(out)["steps"]
    assert list(steps) == ["env", "corpus", "disk"] and steps["disk"]["status"] == "ok"
    assert set(steps["disk"]["runs"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert all(len(v) == 1 and v[0] > 0 for v in steps["disk"]["runs"].values())
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.json", "gpu.log", "summary.md"]
    assert "## disk" in (out / "summary.md").read_text()


def test_the_handover_step_records_both_ways_without_a_corpus(tmp_path):
    from benchmarks.suites.pin_handover import WAYS

    out = tmp_path / "out"
    proc = bench_gpu("--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "handover", "--quick",
                     "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = results(out)["steps"]
    assert list(steps) == ["env", "handover"] and steps["handover"]["status"] == "ok"
    assert "--pin" not in steps["handover"]["command"]  # no CUDA here: the stand-in pin thread
    assert set(steps["handover"]["runs"]) == set(WAYS)
    assert all(run["batches"] == 5 for runs in steps["handover"]["runs"].values() for run in runs)
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.json", "gpu.log", "summary.md"]
    assert "## handover" in (out / "summary.md").read_text()


def test_profile_calls_sums_each_calls_op_times_and_tables_them():
    """What the nvjpeg step writes to nvjpeg-profile.txt, here on CPU ops alone."""
    a = torch.randn(128, 128)
    from benchmarks.suites.gpu_decode import profile_calls

    totals, tables = profile_calls(lambda: (a @ a).relu(), 4, cuda=False)
    assert totals["calls"] == 4 and totals["wall_ms_per_call"] > 0
    assert 0 < totals["host_op_ms_per_call"] <= totals["wall_ms_per_call"]
    assert totals["device_ms_per_call"] == 0
    assert "aten::mm" in tables and "aten::relu" in tables


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_test_file_that_needs_cuda_is_in_the_one_cuda_test_list():
    """The tests step runs suites/cuda_tests.py's list: a test skipped without CUDA that is not
    listed would never run on the GPU machine."""
    from benchmarks.suites.cuda_tests import CUDA_TESTS

    listed = {entry.split("::")[0] for entry in CUDA_TESTS}
    assert all(os.path.isfile(os.path.join(ROOT, path)) for path in listed), listed
    tests = os.path.join(ROOT, "tests")
    skips = re.compile(r"(skipif\(|^\s*if )not torch\.cuda\.is_available\(\)", re.M)
    needing = {f"tests/{name}" for name in os.listdir(tests)
               if name.endswith(".py") and skips.search(open(os.path.join(tests, name)).read())}
    assert needing and needing <= listed, needing - listed
    parser = gpu.argparse.ArgumentParser()
    gpu.add_arguments(parser)
    assert parser.parse_args([]).tests == CUDA_TESTS  # the step's default is that list, not a copy


def run_suite(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "suites", script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_the_corpus_and_scaling_steps_run_alone_as_suites(tmp_path):
    proc = run_suite("corpus.py", "--workdir", str(tmp_path / "work"), "--images", "20", "--synthetic")
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = json.loads(proc.stdout)
    assert made["images"] == 20 and made["made_by"] == "packer.synth (synthetic images)"
    again = json.loads(run_suite("corpus.py", "--workdir", str(tmp_path / "work"), "--images", "20",
                                 "--synthetic").stdout)
    assert again["made_by"].startswith("reused") and again["lmdb"] == made["lmdb"]
    rows = tmp_path / "scaling.json"
    proc = run_suite("scaling.py", made["folder"], made["lmdb"], "--workers", "1", "--quick", "--seconds", "0.5",
                     "--device", "cpu", "--workdir", str(tmp_path / "scaling"), "--json", str(rows))
    assert proc.returncode == 0, proc.stderr[-3000:]
    entry = json.loads(rows.read_text())
    assert entry["per_core"]["median"] > 0 and entry["goal"] == "fraction >= 0.9 at 16 workers"
    assert [r["workers"] for r in entry["rows"]] == [1] and entry["rows"][0]["parallel_samples_per_s"] > 0
    assert "| 1 workers |" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_the_gpu_decode_suite_without_cuda_says_so(tmp_path):
    proc = run_suite("gpu_decode.py", str(tmp_path / "absent.lmdb"))
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr and "Traceback" not in proc.stderr


def test_the_summary_holds_every_steps_table_in_the_steps_order(tmp_path):
    run = gpu.Run(str(tmp_path / "out"), 60, ["--steps", "threads,scaling"])
    tables = {step: f"TABLE OF {step}" for step in gpu.STEPS}
    gpu.write_summary(run, dict(reversed(list(tables.items()))))
    text = (tmp_path / "out" / "summary.md").read_text()
    places = [text.index(f"## {step}\n\nTABLE OF {step}") for step in gpu.STEPS]
    assert places == sorted(places)

