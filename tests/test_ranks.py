"""readers.ranks: who this process is (rank, world, worker) and how work is dealt to ranks."""
from __future__ import annotations

import pytest

from readers import ranks


def test_one_rank_without_a_process_group_or_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ranks.world() == (0, 1)


def test_the_launcher_environment_is_the_seam(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert ranks.world() == (2, 4)
    assert ranks.world(0, 1) == (0, 1)  # a given pair wins
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="need 0 <= RANK < WORLD_SIZE"):
        ranks.world()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="must be integers"):
        ranks.world()


@pytest.mark.parametrize("rank, world_size", [(None, 2), (1, None), (2, 2), (-1, 2)])
def test_half_or_out_of_range_pairs_are_refused(rank, world_size):
    with pytest.raises(ValueError, match="Who: pass rank and world_size together"):
        ranks.check_rank(rank, world_size, "Who")


def test_local_world_size_defaults_to_one(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks.local_world_size() == 8
    for value in ("", "x", "0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
        assert ranks.local_world_size() == 1


def test_local_world_size_without_local_world_size_is_the_launchers_ranks_per_node(monkeypatch):
    """Lightning's launcher sets LOCAL_RANK and WORLD_SIZE, not LOCAL_WORLD_SIZE (its ranks
    are run for real in tests/test_frameworks.py)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert ranks.local_world_size() == 1  # no launcher of local ranks: RANK/WORLD_SIZE alone name no machine
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.local_world_size() == 4
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert ranks.local_world_size() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's own count comes first
    assert ranks.local_world_size() == 3


def test_outside_a_worker_it_is_worker_zero_of_one():
    assert ranks.worker() == (0, 1)
