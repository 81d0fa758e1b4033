"""The benchmark suite must keep running: a tiny smoke run, the cache control, and compare's gate."""
from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import cache, machine
from benchmarks.__main__ import main as bench_main
from benchmarks.__main__ import parser as bench_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """One tiny end-to-end run: 32 images, one repeat, a fraction of a second per case, one process."""
    work = tmp_path_factory.mktemp("bench")
    out = work / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--generate", "32", "--repeat", "1", "--budget", "0.05",
         "--warmup", "0.01", "--device", "cuda", "--workers", "1", "--batch-size", "8", "--step-ms", "1",
         "--isolation", "run",
         "--workdir", str(work / "wd"), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"results": json.loads(out.read_text()), "stdout": proc.stdout}


def test_smoke_run_records_the_machine_and_config(smoke):
    results = smoke["results"]
    assert results["schema"] == 1
    for key in ("cpu", "cpus_usable", "ram_bytes", "torch", "cuda", "gpu", "disk", "memory_reclaim"):
        assert key in results["machine"]
    assert results["config"]["corpus"]["images"] == 32
    assert results["config"]["warm_compacts"] is cache.can_compact()  # as root: warm reloads compact first
    assert results["config"]["repeat"] == 1


def test_cuda_is_used_when_present_and_its_absence_is_reported(smoke):
    import torch

    results = smoke["results"]
    if torch.cuda.is_available():
        assert results["config"]["device"] == "cuda" and results["machine"]["gpu"]
    else:
        assert results["config"]["device"] == "cpu"
        assert "--device cuda requested but CUDA is not available: ran on cpu" in smoke["stdout"]


def test_every_available_case_produced_a_positive_figure(smoke):
    results = smoke["results"]
    assert results["ceiling"]["status"] == "ok" and results["ceiling"]["median"] > 0
    assert results["pack"]["tar"]["median"] > 0
    assert results["sources"]["folder"]["available"] and results["sources"]["lmdb"]["available"]
    for name, entry in results["sources"].items():
        if not entry["available"]:
            assert entry["reason"]
            continue
        for measure in ("raw", "decode", "augment", "e2e"):
            for state in ("cold", "warm"):
                case = entry["measures"][measure][state]
                assert case["status"] == "ok", (name, measure, state, case.get("error"), case.get("traceback"))
                assert case["median"] > 0 and case["samples"][0] > 0
                assert len(case["resident"]) == 1
        assert 0 <= entry["measures"]["e2e"]["warm"]["wait_fraction"]["median"] <= 1
    for fmt, case in results["pack"].items():
        assert case["status"] in ("ok", "n/a"), case
        assert case["status"] == "n/a" or case["median"] > 0


def test_warm_runs_read_epoch_after_epoch_and_cold_runs_one_pass(smoke):
    results = smoke["results"]
    images = results["config"]["corpus"]["images"]
    for name in ("folder", "lmdb", "hdf5"):
        raw = results["sources"][name]["measures"]["raw"]
        # 32 records take milliseconds: a warm run fills its 0.05 s budget with further epochs.
        assert raw["warm"]["samples"][0] > 2 * images, name
        if raw["warm"]["resident"] != [None]:  # mincore available
            assert raw["warm"]["resident_after"] == [1.0] and raw["warm"]["cache_verified"] is True
    for name, entry in results["sources"].items():
        if entry["available"]:
            assert entry["measures"]["raw"]["cold"]["samples"][0] <= images, name
            assert "resident_after" not in entry["measures"]["raw"]["cold"]


def test_ratios_compare_each_packed_source_with_the_folder(smoke):
    ratios = smoke["results"]["ratios"]
    assert ratios["lmdb"]["raw_warm_vs_folder"] > 0
    assert ratios["lmdb"]["pack_vs_tar"] > 0
    assert ratios["folder"]["e2e_warm_vs_ceiling"] > 0


def test_warm_raw_rows_carry_the_memory_copy_reference(smoke):
    results = smoke["results"]
    for name, entry in results["sources"].items():
        if not entry["available"]:
            continue
        case = entry["measures"]["raw"]["warm"]
        assert len(case["memory_copy"]["runs"]) == 1 and case["memory_copy"]["median"] > 0
        assert "memory_copy" not in entry["measures"]["raw"]["cold"]
        assert results["ratios"][name]["raw_warm_vs_memory"] == pytest.approx(
            case["median"] / case["memory_copy"]["median"])
    assert "Memory copy, the reference for raw warm rows" in smoke["stdout"]


def test_packed_warm_raw_rows_carry_the_bare_read_floor(smoke):
    results = smoke["results"]
    for name, entry in results["sources"].items():
        case = entry["measures"]["raw"]["warm"] if entry["available"] else {}
        if name in ("lmdb", "hdf5", "wds (map)"):
            assert len(case["bare_read"]["runs"]) == 1 and case["bare_read"]["median"] > 0, name
            assert results["ratios"][name]["raw_warm_vs_bare_read"] == pytest.approx(
                case["median"] / case["bare_read"]["median"])
        else:  # a file per record, shards streamed, or no packer reader: nothing to place
            assert "bare_read" not in case, name
    assert "Bare read, the floor for packed raw warm rows" in smoke["stdout"]


@pytest.mark.parametrize("name, fmt, suffix", [("lmdb", "lmdb", ".lmdb"), ("hdf5", "hdf5", ".h5"),
                                               ("wds (map)", "wds", ".wds")])
def test_bare_read_reads_exactly_each_records_bytes(tmp_path, name, fmt, suffix):
    from benchmarks.measures import BareRead
    from benchmarks.sources import SOURCES
    from conftest import class_sorted_tree

    from packer.pack import pack

    src = class_sorted_tree(tmp_path / "src", classes=2, per_class=3)
    out = str(tmp_path / f"d{suffix}")
    pack(str(src), fmt, out, progress=False)
    ctx = {"folder": str(src), "packed": {fmt: out}}
    dataset = SOURCES[name].open(ctx, "raw")
    dataset.open()
    try:
        extents = list(dataset.reader.record_extents(np.arange(len(dataset))))
        # Every record is placed, and the bytes at its extent are the record's image, byte for byte.
        assert len(extents) == len(dataset) == 6
        for i, (fd, offset, length) in enumerate(extents):
            assert os.pread(fd, length, offset) == dataset[i][0]
    finally:
        dataset.close()
    assert BareRead.rate_of(SOURCES[name], ctx, 0.05, 0) > 0
    assert BareRead.rate_of(SOURCES["folder"], ctx, 0.05, 0) is None  # a file per record: nothing to place
    assert BareRead.rate_of(SOURCES["webdataset (peer)"], ctx, 0.05, 0) is None


def test_table_has_a_row_per_source_and_says_why_one_is_missing(smoke):
    stdout, results = smoke["stdout"], smoke["results"]
    rows = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(results["sources"])
    for name, entry in results["sources"].items():
        assert any(row.startswith(f"| {name} |") for row in rows)
        if not entry["available"]:
            assert f"{name}: n/a ({entry['reason']})" in stdout
    assert "Machine:" in stdout and "Ceiling:" in stdout


def write_tree(root, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def test_memory_reclaim_names_damon_pageout_and_a_reporting_balloon(tmp_path):
    kdamond = "kernel/mm/damon/admin/kdamonds/0"
    context = f"{kdamond}/contexts/0"
    write_tree(tmp_path, {
        f"{kdamond}/state": "on",
        f"{context}/monitoring_attrs/intervals/aggr_us": "5000000",
        f"{context}/schemes/0/action": "pageout",
        f"{context}/schemes/0/access_pattern/age/min": "6",
        f"{context}/schemes/1/action": "stat",  # monitoring only: takes nothing
        "bus/virtio/devices/virtio0/device": "0x0005",
        "bus/virtio/devices/virtio0/features": "0110010" + "0" * 57,
        "bus/virtio/devices/virtio1/device": "0x0002",  # a block device
    })
    assert machine.memory_reclaim(str(tmp_path)) == ["DAMON pageout of memory idle for 30 s",
                                                      "virtio balloon with free page reporting"]
    write_tree(tmp_path, {f"{kdamond}/state": "off", "bus/virtio/devices/virtio0/features": "011" + "0" * 61})
    assert machine.memory_reclaim(str(tmp_path)) == ["virtio balloon"]
    assert machine.memory_reclaim(str(tmp_path / "absent")) == []


def skip_without_page_cache(folder) -> None:
    if cache.resident_fraction([]) is None:
        pytest.skip("mincore not available here")
    if machine.mount_of(str(folder)).get("fstype") in ("tmpfs", "ramfs"):
        pytest.skip("a RAM filesystem has no page cache to evict")


def test_eviction_empties_the_page_cache_and_loading_fills_it(tmp_path):
    skip_without_page_cache(tmp_path)
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(4 << 20))
    assert cache.prepare([str(path)], "cold") == 0.0
    assert cache.prepare([str(path)], "warm") == 1.0
    assert cache.compact() is cache.can_compact()  # the kernel takes it where this process may ask
    assert cache.verdict("cold", [0.5]) == (False, "eviction did not take effect: 50% of the data stayed cached")
    assert cache.verdict("warm", [1.0])[0] is True
    # A warm run is checked again at its end: data reclaimed mid-run makes it unverified.
    cache.evict([str(path)])
    after = cache.resident_fraction([str(path)])
    assert cache.verdict("warm", [1.0], [after]) == (
        False, "the page cache lost data during a run: 0% still resident at its end")
    assert cache.verdict("warm", [1.0], [1.0])[0] is True


def test_eviction_of_a_mapped_file_is_detected_not_assumed(tmp_path):
    skip_without_page_cache(tmp_path)
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))  # fault every page in, as LMDB does
        resident = cache.prepare([str(path)], "cold")
    assert resident == 1.0  # the kernel keeps pages a process maps
    assert cache.verdict("cold", [resident])[0] is False


def test_the_gpu_step_is_calibrated_to_its_duration():
    from benchmarks.measures import repetitions_for

    # 20 sleeps of 1 ms last 20 ms; sleep overshoots a little, so a few fewer may do.
    assert repetitions_for(lambda k: time.sleep(0.001 * k), 0.02, calibrate_s=0.05) in range(10, 21)


@pytest.mark.parametrize("command", ["run", "compare", "trend"])
def test_every_option_is_documented_in_the_manual(command, capsys):
    with pytest.raises(SystemExit):
        bench_main([command, "--help"])
    flags = set(re.findall(r"--[a-z][a-z-]+", capsys.readouterr().out)) - {"--help"}
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        section = f.read()
    assert f"python -m benchmarks {command}" in section
    assert flags and all(f"`{flag}" in section for flag in flags), flags


def test_the_command_line_names_every_measure_and_starts_without_torch():
    """compare and trend run nightly: importing torch for their parser would cost each a second or two."""
    from benchmarks.measures import MEASURES
    from benchmarks.names import MEASURE_NAMES

    assert tuple(MEASURES) == MEASURE_NAMES
    probe = "import sys\nfrom benchmarks.__main__ import parser\nfrom benchmarks import compare, trend\nparser()\n" \
            "sys.exit('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:] or "torch was imported"


def test_every_option_and_argument_has_a_help_text():
    def parsers(parser, name):
        yield name, parser
        for action in parser._actions:  # argparse offers no public walk over its subcommands
            for sub, child in getattr(action, "choices", None).items() if isinstance(action, argparse._SubParsersAction) else ():
                yield from parsers(child, f"{name} {sub}")

    for name, parser in parsers(bench_parser(), "python -m benchmarks"):
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.dest} has no help text"
    gpu_help = bench_parser()._subparsers._group_actions[0].choices["gpu"].format_help()
    assert "the CUDA tests" in gpu_help
    for word in ("$OUT", ".carry", "10-minute", "han dover"):
        assert word not in gpu_help


def results_with(rate: float, pack_s: float, status: str = "ok") -> dict:
    case = {"status": status, "median": rate} if status == "ok" else {"status": "error", "error": "boom"}
    return {"machine": {"cpu": "x"}, "ceiling": {"status": "ok", "median": 500.0},
            "pack": {"lmdb": {"status": "ok", "median": pack_s}, "hdf5": {"status": "n/a"}},
            "sources": {"lmdb": {"measures": {"raw": {"warm": case}}}}}


@pytest.mark.parametrize("new, code", [
    (results_with(950.0, 10.0), 0),  # 5% slower: inside tolerance
    (results_with(1200.0, 9.0), 0),  # faster
    (results_with(850.0, 10.0), 1),  # throughput fell 15%
    (results_with(1000.0, 12.0), 1),  # pack took 20% longer
    (results_with(0.0, 10.0, status="error"), 1),  # a case that used to work now fails
], ids=["within-tolerance", "faster", "slower", "pack-slower", "now-error"])
def test_compare_exits_non_zero_on_a_regression(tmp_path, capsys, new, code):
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps(results_with(1000.0, 10.0)))
    new_path.write_text(json.dumps(new))
    assert bench_main(["compare", str(old_path), str(new_path), "--tolerance", "0.1"]) == code
    assert "regression(s) beyond 10%" in capsys.readouterr().out


def test_compare_shows_but_does_not_judge_the_references(tmp_path, capsys):
    old, new = results_with(1000.0, 10.0), results_with(1000.0, 10.0)
    new["ceiling"]["median"] = 100.0
    old["pack"]["tar"], new["pack"]["tar"] = {"status": "ok", "median": 1.0}, {"status": "ok", "median": 5.0}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert bench_main(["compare", str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 0
    assert "reference pack tar: 1 -> 5 (+400.0%)" in capsys.readouterr().out


def test_compare_tolerance_is_adjustable(tmp_path):
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps(results_with(1000.0, 10.0)))
    new_path.write_text(json.dumps(results_with(850.0, 10.0)))
    assert bench_main(["compare", str(old_path), str(new_path), "--tolerance", "0.2"]) == 0


def test_compare_rejects_unreadable_results(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert bench_main(["compare", str(bad), str(bad)]) == 2
    assert "cannot read results" in capsys.readouterr().err


def crashed(results: dict) -> dict:
    """results with every case and pack failed as run.py records a case process that died."""
    dead = {"status": "error", "error": "case process exited -9: "}
    return {**results, "ceiling": dead, "pack": {"lmdb": dead},
            "sources": {"lmdb": {"measures": {"raw": {"warm": dead}}}}}


@pytest.mark.parametrize("new", [
    results_with(float("nan"), float("nan")),
    results_with(float("inf"), 10.0),
    {},
    {"machine": {"cpu": "x"}, "sources": {}},
    crashed(results_with(1000.0, 10.0)),
    {**results_with(1000.0, 10.0), "pack": {"lmdb": {"status": "crashed"}},
     "sources": {"lmdb": {"measures": {"raw": {"warm": {"status": "crashed"}}}}}},
    results_with("fast", 10.0),
], ids=["nan", "infinite", "empty", "no-cases", "every-case-crashed", "status-crashed", "not-a-number"])
def test_compare_fails_on_results_it_cannot_judge(tmp_path, capsys, new):
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps(results_with(1000.0, 10.0)))
    new_path.write_text(json.dumps(new))
    assert bench_main(["compare", str(old_path), str(new_path)]) == 1
    assert re.search(r"^ *(REGRESSION|UNJUDGED|EMPTY) ", capsys.readouterr().out, re.M)


def test_a_nan_in_old_fails_the_gate_instead_of_switching_its_case_off(tmp_path, capsys):
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps(results_with(float("nan"), 10.0)))
    new_path.write_text(json.dumps(results_with(1.0, 10.0)))  # a 99.9% fall hidden behind the NaN
    assert bench_main(["compare", str(old_path), str(new_path)]) == 1
    assert "UNJUDGED lmdb raw warm: nan -> 1 (OLD median is not a finite positive number)" in capsys.readouterr().out


@pytest.mark.parametrize("text, what", [
    ("[1, 2]", "a JSON list, not the object"),
    ('{"sources": []}', "'sources' is a JSON list"),
    ('{"sources": {"lmdb": 3}}', "sources.lmdb has no 'measures' object"),
    ('{"pack": "fast"}', "'pack' is a JSON str"),
    ("", "not JSON"),
], ids=["list", "sources-list", "source-not-object", "pack-string", "empty-file"])
def test_compare_says_which_file_is_malformed_and_exits_2(tmp_path, capsys, text, what):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(results_with(1000.0, 10.0)))
    bad.write_text(text)
    assert bench_main(["compare", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"cannot read results: {bad}: {what}" in err and "Traceback" not in err


def test_compare_of_a_missing_file_exits_2_naming_it(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(results_with(1000.0, 10.0)))
    assert bench_main(["compare", str(tmp_path / "absent.json"), str(good)]) == 2
    assert f"cannot read results: {tmp_path / 'absent.json'}: cannot read it" in capsys.readouterr().err


def test_run_refuses_a_workdir_corpus_it_did_not_make(tmp_path, capsys):
    corpus = tmp_path / "wd" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "thesis.tex").write_text("years of work")
    assert bench_main(["run", "--generate", "20", "--workdir", str(tmp_path / "wd"), "--formats", "lmdb"]) == 2
    assert (corpus / "thesis.tex").read_text() == "years of work"
    assert f"{corpus} exists and was not made by the benchmark suite" in capsys.readouterr().err


def test_run_replaces_only_a_corpus_its_stamp_says_it_made(tmp_path):
    from benchmarks.run import reuse_corpus

    corpus = tmp_path / "corpus"
    reuse_corpus(str(corpus), 20, seed=0)
    stamp = json.loads((tmp_path / "corpus.json").read_text())
    assert stamp["complete"] is True and stamp["images"] == 20
    first = sorted(p.name for p in corpus.rglob("*.JPEG"))
    (corpus / "marker").write_text("kept while the stamp matches")
    reuse_corpus(str(corpus), 20, seed=0)
    assert (corpus / "marker").exists()
    reuse_corpus(str(corpus), 30, seed=0)  # other parameters: its own corpus, replaced
    assert not (corpus / "marker").exists() and len(list(corpus.rglob("*.JPEG"))) >= 30 > len(first)


def test_an_interrupted_corpus_is_the_suites_own_and_is_made_again(tmp_path):
    from benchmarks.run import reuse_corpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "half-written.jpg").write_bytes(b"\xff\xd8")
    (tmp_path / "corpus.json").write_text(json.dumps({"images": 20, "seed": 0, "shape": [2, 10],
                                                      "complete": False}))
    reuse_corpus(str(corpus), 20, seed=0)
    assert not (corpus / "half-written.jpg").exists()
    assert json.loads((tmp_path / "corpus.json").read_text())["complete"] is True


@pytest.mark.skipif(not cache.CAN_EVICT, reason="needs posix_fadvise to evict")
def test_read_ahead_study_reports_every_depth_and_restores_the_default(tmp_path):
    from benchmarks.suites import read_ahead
    from packer import pack
    from packer.synth import make_corpus
    from readers import sampler as sampler_module

    make_corpus(str(tmp_path / "src"), classes=2, per_class=15)
    packed = tmp_path / "d.h5"
    pack(str(tmp_path / "src"), "hdf5", str(packed), progress=False, workers=1)
    default = sampler_module.AHEAD
    out = tmp_path / "runs.json"
    assert read_ahead.main([str(packed), "--ahead", "0,16", "--records", "20", "--repeats", "2",
                            "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"0", "16"} and all(len(v) == 2 and min(v) > 0 for v in runs.values())
    assert sampler_module.AHEAD == default


def test_warm_state_study_reports_every_fill(tmp_path, capsys):
    from benchmarks.suites import warm_state
    from packer import pack
    from packer.synth import make_corpus

    make_corpus(str(tmp_path / "src"), classes=2, per_class=15)
    packed = tmp_path / "d.lmdb"
    pack(str(tmp_path / "src"), "lmdb", str(packed), progress=False, workers=1)
    out = tmp_path / "runs.json"
    assert warm_state.main([str(packed), "--seconds", "0.05", "--repeats", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == set(warm_state.FILLS)
    for run in runs.values():
        assert run["reader"][0] > 0 and run["bare"][0] > 0
        assert run["resident"][0] in (None, 1.0)  # every fill leaves all of the data cached
        assert run["large_folios"][0] is None or 0 <= run["large_folios"][0] <= 1
    table = capsys.readouterr().out
    assert all(f"| {how} |" in table for how in warm_state.FILLS)
    with pytest.raises(SystemExit):
        warm_state.main([str(packed), "--fills", "read-through,sideways"])


def test_checked_rows_run_for_packed_map_style_sources_only(smoke):
    results = smoke["results"]
    for name, entry in results["sources"].items():
        checked = entry.get("measures", {}).get("checked")
        if name in ("lmdb", "hdf5", "wds (map)") and entry["available"]:
            for state in ("cold", "warm"):
                assert checked[state]["status"] == "ok" and checked[state]["median"] > 0, (name, state, checked[state])
            assert results["ratios"][name]["checked_warm_vs_raw"] > 0
        else:
            assert checked is None, name
    assert "checked: raw reads with each record's checksum checked" in smoke["stdout"]
def test_map_style_rows_carry_the_plain_dataloader_read(smoke):
    results = smoke["results"]
    for name, entry in results["sources"].items():
        if not entry["available"]:
            continue
        cases = entry["measures"].get("loader", {})
        if name in ("folder", "lmdb", "hdf5", "wds (map)"):
            for state in ("cold", "warm"):
                assert cases[state]["status"] == "ok" and cases[state]["median"] > 0, (name, state, cases[state])
            assert cases["cold"]["samples"][0] <= results["config"]["corpus"]["images"], name
        else:  # shards streamed, or a peer: no DataLoader over a map-style packer dataset
            assert not cases, name
    assert results["ratios"]["lmdb"]["loader_cold_vs_folder"] > 0
    assert results["ratios"]["lmdb"]["loader_cold_vs_disk"] > 0  # the disk's sequential rate, measured in the run
    assert "loader ×folder (cold / warm)" in smoke["stdout"]
    assert "loader cold, MB/s over the disk's sequential rate" in smoke["stdout"]


def test_cases_of_one_cell_run_back_to_back():
    from benchmarks.run import cell_major

    groups = [[{"source": s, "measure": m, "cache": c}] for s in ("folder", "lmdb")
              for m in ("raw", "e2e") for c in ("cold", "warm")]
    order = [(g[0]["measure"], g[0]["cache"], g[0]["source"]) for g in cell_major(groups, ["raw", "e2e"],
                                                                                   ["cold", "warm"])]
    assert order == [(m, c, s) for m in ("raw", "e2e") for c in ("cold", "warm") for s in ("folder", "lmdb")]


def test_cells_of_interleaved_measures_are_joined_into_one_group():
    from benchmarks.run import cell_major, interleaved, join_cells

    measures = ["raw", "loader", "e2e"]
    groups = [[{"source": s, "measure": m, "cache": c}] for s in ("folder", "lmdb", "hdf5")
              for m in measures for c in ("cold", "warm")]
    joined = join_cells(cell_major(groups, measures, ["cold", "warm"]))
    cells = [[(g["measure"], g["cache"], g["source"]) for g in group] for group in joined]
    assert cells[:6] == [[("raw", c, s)] for c in ("cold", "warm") for s in ("folder", "lmdb", "hdf5")]
    assert cells[6:] == [[(m, c, s) for s in ("folder", "lmdb", "hdf5")] for m in ("loader", "e2e")
                         for c in ("cold", "warm")]
    assert [interleaved(group) for group in joined] == [False] * 6 + [True] * 4


def test_an_e2e_cell_runs_round_by_round_and_rates_each_round_against_the_folder(tmp_path, monkeypatch):
    """Round r runs every source with seed r, starting one source further each round; each
    source's ratio to the folder is taken round by round, and the report uses its median."""
    from benchmarks import case as C, report
    from benchmarks.measures import Options
    from packer.pack import pack
    from packer.synth import make_corpus

    folder, packed = tmp_path / "src", tmp_path / "data.lmdb"
    make_corpus(str(folder), classes=2, per_class=6, seed=0)
    pack(str(folder), "lmdb", str(packed), workers=1, progress=False)
    ctx = {"folder": str(folder), "packed": {"lmdb": str(packed)}}
    opts = Options(budget=0.05, warmup=0.01, repeat=3, batch_size=4, workers=0, step_ms=0)
    timed, original = [], C.CaseRun.timed
    monkeypatch.setattr(C.CaseRun, "timed", lambda self, r: timed.append((self.case["source"], r)) or original(self, r))
    cases = [{"source": s, "measure": "e2e", "cache": "warm"} for s in ("folder", "lmdb", "wds")]
    results = C.run_cell(cases, ctx, opts)

    assert timed == [("folder", 0), ("lmdb", 0), ("lmdb", 1), ("folder", 1), ("folder", 2), ("lmdb", 2)]
    folder_case, lmdb_case, wds_case = results
    assert wds_case["status"] == "error" and "wds" in wds_case["error"]  # not packed: its case fails alone
    assert folder_case["status"] == lmdb_case["status"] == "ok" and "vs_folder" not in folder_case
    rounds = [a / b for a, b in zip(lmdb_case["runs"], folder_case["runs"])]
    assert lmdb_case["vs_folder"]["runs"] == pytest.approx(rounds)
    for case in (folder_case, lmdb_case):  # CPU time over the window: here all in the main process (no workers)
        assert len(case["cpu_ms_per_sample"]["main"]["runs"]) == 3 and case["cpu_ms_per_sample"]["main"]["min"] > 0
        assert case["cpu_ms_per_sample"]["workers"]["max"] == 0
    cpu = [sum(c["cpu_ms_per_sample"][part]["runs"][r] for part in ("main", "workers"))
           for r in range(3) for c in (folder_case, lmdb_case)]
    assert lmdb_case["cpu_vs_folder"]["runs"] == pytest.approx([cpu[2 * r] / cpu[2 * r + 1] for r in range(3)])
    results = {"config": {"workers": 0, "cache": ["warm"]},
               "sources": {s: {"available": True, "measures": {"e2e": {"warm": c}}}
                           for s, c in (("folder", folder_case), ("lmdb", lmdb_case))}}
    assert report.ratios(results)["lmdb"]["e2e_warm_vs_folder"] == pytest.approx(sorted(rounds)[1])
    note = " ".join(report.round_ratio_note(results))
    assert "the median of the per-round ratios" in note and "CPU per sample" in note


def test_children_cpu_counts_a_busy_childs_cpu_seconds():
    from benchmarks.measures import children_cpu

    if children_cpu() is None:
        pytest.skip("no /proc/<pid>/task/<tid>/children here (not Linux)")
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ninput()"
    child = subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE)
    try:
        deadline, seen = time.time() + 60, 0.0
        while seen < 0.25 and time.time() < deadline:  # the child spins 0.3 s of CPU (/proc counts ticks), then waits
            time.sleep(0.05)
            seen = children_cpu().get(child.pid, 0.0)
        assert 0.25 <= seen < 5
    finally:
        child.communicate(b"\n", timeout=30)
    assert child.pid not in children_cpu()  # reaped: no longer a child


def test_gpu_host_study_times_every_case_and_leaves_no_stand_in_behind(tmp_path, capsys):
    import sys

    from benchmarks.suites import gpu_host
    from packer import pack
    from packer.synth import make_corpus

    make_corpus(str(tmp_path / "src"), classes=2, per_class=15)
    packed = tmp_path / "d.lmdb"
    pack(str(tmp_path / "src"), "lmdb", str(packed), progress=False, workers=1)
    had_torchvision = "torchvision" in sys.modules
    out = tmp_path / "runs.json"
    assert gpu_host.main([str(packed), "--batch", "8", "--repeats", "1", "--batches", "2", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"decoder: EncodedBatch", "decoder: list of bytes", "reference: a bytearray per image",
                          "handover: list of bytes", "handover: EncodedBatch",
                          "transform: RandomResizedCrop.batch, tiny images",
                          "reference: window by window, tiny images",
                          "transform: the crop draws alone (375x500)"}
    assert all(case["median"] > 0 and len(case["runs"]) == 1 for case in cases.values())
    work = json.loads(out.read_text())["resize_work"]
    assert work["multiply_adds_per_image"] > 0 and work["padded_over_own"] >= 1.0 and work["groups"] >= 1
    assert ("torchvision" in sys.modules) == had_torchvision
    assert "decoder: EncodedBatch" in capsys.readouterr().out


@pytest.mark.parametrize("state, crop", [
    ("warm", False), ("warm", True),
    pytest.param("cold", False, marks=pytest.mark.skipif(not cache.CAN_EVICT, reason="needs posix_fadvise to evict"))])
def test_worker_heap_study_reads_each_batch_size_both_ways_and_restores_the_setting(tmp_path, capsys, monkeypatch,
                                                                                    state, crop):
    from benchmarks.suites import worker_heap
    from packer import pack
    from packer.synth import make_corpus
    from readers import heap

    if heap.glibc() is None:
        pytest.skip("readers.heap sets glibc's malloc thresholds; this C library is not glibc")
    make_corpus(str(tmp_path / "src"), classes=2, per_class=20)
    packed = tmp_path / "d.lmdb"
    pack(str(tmp_path / "src"), "lmdb", str(packed), progress=False, workers=1)
    monkeypatch.delenv(heap.ENV, raising=False)
    out = tmp_path / "runs.json"
    assert worker_heap.main([str(packed), "--folder", str(tmp_path / "src"), "--batch", "4", "8", "--records", "16",
                             "--cache", state, *(["--crop"] if crop else []), "--repeats", "1",
                             "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cache"] == state and result["crop"] == crop
    rows = result["rows"]
    assert [(row["source"], row["batch"]) for row in rows] == [("d.lmdb", 4), ("d.lmdb", 8), ("folder", 4),
                                                               ("folder", 8)]
    for row in rows:
        for setting in worker_heap.SETTINGS:
            assert row[setting]["samples/s"] > 0 and row[setting]["faults/sample"] >= 0
        assert row["kept / defaults"] > 0
    assert heap.ENV not in os.environ
    assert "kept/defaults" in capsys.readouterr().out


@pytest.mark.skipif(not cache.CAN_EVICT, reason="needs posix_fadvise to evict")
def test_disk_depth_study_reports_every_depth_against_the_first(tmp_path, capsys):
    from benchmarks.suites import disk_depth
    from packer import pack
    from packer.synth import make_corpus

    make_corpus(str(tmp_path / "src"), classes=2, per_class=15)
    packed = tmp_path / "d.h5"
    pack(str(tmp_path / "src"), "hdf5", str(packed), progress=False, workers=1)
    out = tmp_path / "runs.json"
    assert disk_depth.main([str(packed), "--depths", "1,4", "--seconds", "0.05", "--repeats", "2",
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"1", "4"} and all(len(v) == 2 and min(v) > 0 for v in result["runs"].values())
    assert result["record_bytes"] >= 4096 and result["file"] == str(packed)
    assert "| 1 | " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        disk_depth.main([str(packed), "--depths", "0,4"])


@pytest.mark.parametrize("how", [["--workers", "1"], ["--alone"]])
def test_pin_handover_study_hands_every_batch_over_both_ways(tmp_path, capsys, how):
    import torch

    from benchmarks.suites import pin_handover

    out = tmp_path / "runs.json"
    assert pin_handover.main(["--batch", "4", "--size", "64", "--batches", "5", "--repeats", "2",
                              "--json", str(out), *how]) == 0
    result = json.loads(out.read_text())
    assert set(result["runs"]) == set(pin_handover.WAYS) == set(result["summary"])
    for runs in result["runs"].values():  # the first batch starts the clock: the other four are timed
        assert [run["batches"] for run in runs] == [4, 4]
        assert all(run["longest_ms_median"] >= 0 and run["handover_ms_per_batch"] > 0 for run in runs)
    assert "given back first" in capsys.readouterr().out
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            pin_handover.main(["--pin"])


@pytest.mark.skipif(not cache.CAN_EVICT, reason="needs posix_fadvise (the cache studies' common check)")
@pytest.mark.parametrize("fmt,name,fill", [("lmdb", "d.lmdb", "read-through"), ("hdf5", "d.h5", "random-epoch")])
def test_map_reads_study_times_every_case_over_the_readers_own_extents(tmp_path, capsys, fmt, name, fill):
    from benchmarks.suites import map_reads
    from packer import pack
    from packer.synth import make_corpus

    make_corpus(str(tmp_path / "src"), classes=2, per_class=10)
    packed = tmp_path / name
    pack(str(tmp_path / "src"), fmt, str(packed), progress=False, workers=1)
    paths, spans = map_reads.extents(str(packed), 1000, seed=0)
    assert len(spans) == 20 and all(os.path.isfile(p) and str(tmp_path) in p for p in paths)
    # each span is a record's image bytes, exactly: what the reader returns for it
    from packer.formats import open_reader
    reader = open_reader(str(packed))
    images = sorted(reader.read_image(i)[0] for i in range(len(reader)))
    reader.close()
    with open(paths[0], "rb") as f:
        data = f.read()
    assert sorted(data[at:at + n] for _, at, n in spans) == images
    out = tmp_path / "runs.json"
    assert map_reads.main([str(packed), "--repeats", "1", "--fill", fill, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert result["fill"] == fill
    assert set(runs) == set(map_reads.CASES) and all(len(v) == 1 and v[0] > 0 for v in runs.values())
    assert "| map + xxh3, fresh |" in capsys.readouterr().out


def test_keyed_cost_study_times_one_setting_per_process(tmp_path, capsys):
    from benchmarks.suites import keyed_cost
    from packer import pack
    from packer.synth import make_corpus

    make_corpus(str(tmp_path / "src"), classes=2, per_class=10)
    packed = tmp_path / "d.lmdb"
    pack(str(tmp_path / "src"), "lmdb", str(packed), progress=False, workers=1)
    for keyed in ("on", "off"):
        assert keyed_cost.main([str(packed), "--keyed", keyed, "--records", "8", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "keyed=on workers=0 batch=4:" in out and "keyed=off workers=0 batch=4:" in out


def test_suite_time_measures_a_pytest_run_and_its_slowest_tests(tmp_path):
    from benchmarks import suitetime

    out = tmp_path / "suite.json"
    assert bench_main(["suite-time", "--out", str(out), "--", "tests/test_crc.py", "-k", "chains_over_pieces",
                       "-n", "0", "-p", "no:cacheprovider"]) == 0
    result = json.loads(out.read_text())
    assert result["exit_code"] == 0 and "1 passed" in result["summary"][0]
    assert 0 < result["wall_s"] <= suitetime.TARGET_SECONDS and result["cpu_s"] > 0
    assert [row["test"] for row in result["slowest"]][:1] == [
        "tests/test_crc.py::test_chains_over_pieces_as_the_hdf5_writer_does"]
    busy = {**result, "load_before": [result["cores"] + 1.0] * 3}
    assert "the machine was busy" in suitetime.report(busy)
    assert "the machine was busy" not in suitetime.report({**busy, "load_before": [0.0] * 3, "load_after": [0.0] * 3})
