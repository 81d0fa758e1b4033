"""Packing in parts on a real Dask cluster: a LocalCluster of worker processes.

The parts run on the cluster's workers (each a process of its own, as on separate
machines sharing a file system), the merge runs here; the result must equal a single
pack. A worker that dies while packing a part is a real process exiting (os._exit):
Dask retries the part on another worker, or, past its allowed failures, the pack fails
naming the part and leaves nothing at OUT.
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer import FORMATS, PackError, pack
from packer.cli import main
from packer.parts import run_part

from test_parts import leftovers, same_bytes, same_dataset, single_pack

# Found, not imported: importing distributed takes a second, paid by every pytest process
# that collects this file; only the one that runs it imports it (the fixtures).
if importlib.util.find_spec("distributed") is None:
    pytest.skip("the Dask tests need packer[dask] (in the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster():
    import distributed

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as local:
        yield local


@pytest.fixture
def allowed_failures(cluster):
    """Set how many worker deaths the scheduler allows a task before giving up on it."""
    scheduler, before = cluster.scheduler, cluster.scheduler.allowed_failures

    def allow(count: int) -> None:
        scheduler.allowed_failures = count

    yield allow
    scheduler.allowed_failures = before


@pytest.fixture
def client(cluster):
    import distributed

    with distributed.Client(cluster) as found:
        found.wait_for_workers(2, timeout=60)
        yield found


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_four_parts_on_dask_equal_a_single_pack(split_tree, tmp_path, client, fmt):
    single = single_pack(split_tree, fmt, tmp_path)
    out = tmp_path / f"dask{FORMATS[fmt].extension}"
    result = pack(str(split_tree), fmt, str(out), executor=client.get_executor(), parts=4, workers=1,
                  progress=False)
    same_dataset(out, single)
    if fmt == "wds":
        same_bytes(out, single)
    merged = result.metadata.parts["merged"]
    assert [p["index"] for p in merged] == [0, 1, 2, 3] and sum(p["count"] for p in merged) == 16
    assert leftovers(tmp_path) == []


def test_parts_default_to_the_cluster_threads(split_tree, tmp_path, client):
    out = tmp_path / "auto.lmdb"
    result = pack(str(split_tree), "lmdb", str(out), executor=client.get_executor(), workers=1, progress=False)
    assert result.metadata.parts["count"] == 2


@pytest.mark.parametrize("decoding", [{"check": "full"}, {"max_side": 48}, {"baseline_420": True}])
def test_decoding_runs_in_daemonic_dask_workers(bad_tree, tmp_path, client, decoding):
    """Dask workers may not start processes: --check full, --max-side and --baseline-420 decode in the worker
    itself, and say so (--max-side failed: 'daemonic processes are not allowed to have children')."""
    single = single_pack(bad_tree, "lmdb", tmp_path, on_error="skip", **decoding)
    out = tmp_path / "full.lmdb"
    result = pack(str(bad_tree), "lmdb", str(out), executor=client.get_executor(), parts=2, on_error="skip",
                  progress=False, **decoding)
    same_dataset(out, single)
    assert any("daemonic" in warning for warning in result.warnings)


def test_cli_packs_on_a_dask_scheduler_by_address(split_tree, tmp_path, cluster, client):
    single = single_pack(split_tree, "wds", tmp_path)
    out = tmp_path / "cli.wds"
    result = CliRunner().invoke(main, ["pack", str(split_tree), "--to", "wds", "--parts", "4", "--dask",
                                       cluster.scheduler_address, "-o", str(out), "--workers", "1"])
    assert result.exit_code == 0, result.output
    same_dataset(out, single)
    same_bytes(out, single)
    assert "merged from 4 parts" in CliRunner().invoke(main, ["info", str(out)]).output


def test_cli_names_an_unreachable_scheduler(split_tree, tmp_path):
    result = CliRunner().invoke(main, ["pack", str(split_tree), "--to", "lmdb", "--parts", "2", "--dask",
                                       "tcp://127.0.0.1:9", "-o", str(tmp_path / "x.lmdb")])
    assert result.exit_code == 1 and "tcp://127.0.0.1:9: cannot reach a Dask scheduler" in result.output


# A worker that dies: the part runs through exit_* instead of run_part, in the worker process.


def exit_once(marker: str, task):
    """Exit the worker process outright the first time (marker not yet there), pack the part after."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os._exit(17)
    return run_part(task)


def exit_always(task):
    os._exit(17)


class DyingPart(concurrent.futures.Executor):
    """Forwards to executor, but part `index` runs through die (picklable) on the worker."""

    def __init__(self, executor, index: int, die):
        self.executor, self.index, self.die = executor, index, die

    def submit(self, fn, *args, **kwargs):
        if args[0].spec.index == self.index:
            return self.executor.submit(self.die, *args, **kwargs)
        return self.executor.submit(fn, *args, **kwargs)


def test_a_part_whose_worker_dies_is_retried_on_another(split_tree, tmp_path, client, allowed_failures):
    allowed_failures(1)
    marker = tmp_path / "died-once"
    single = single_pack(split_tree, "wds", tmp_path)
    out = tmp_path / "retried.wds"
    executor = DyingPart(client.get_executor(), 2, functools.partial(exit_once, str(marker)))
    pack(str(split_tree), "wds", str(out), executor=executor, parts=4, workers=1, progress=False)
    assert marker.exists()  # the first attempt did die
    same_dataset(out, single)
    same_bytes(out, single)
    assert leftovers(tmp_path) == []


def test_a_part_whose_worker_keeps_dying_is_named_and_nothing_is_left(split_tree, tmp_path, client,
                                                                      allowed_failures):
    """Past the allowed failures, Dask gives up on the part (KilledWorker); a part queued on
    the same worker may be given up with it, so part 2 is named first or among the others."""
    allowed_failures(0)
    out = tmp_path / "dead.lmdb"
    executor = DyingPart(client.get_executor(), 2, exit_always)
    with pytest.raises(PackError, match=r"its worker died \(KilledWorker") as caught:
        pack(str(split_tree), "lmdb", str(out), executor=executor, parts=4, workers=1, progress=False)
    message = str(caught.value)
    assert message.startswith("part 2/4 (") or re.search(r"also failed: (part \d, )*part 2\b", message), message
    assert not out.exists() and leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["splits"]
