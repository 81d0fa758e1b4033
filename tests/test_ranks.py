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
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks.local_world_size() == 8
    for value in ("", "x", "0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
        assert ranks.local_world_size() == 1


def test_deal_gives_each_item_to_the_least_loaded_rank():
    owned, load = ranks.deal([("a", 5), ("b", 3), ("c", 1), ("d", 4), ("e", 0)], 2)
    # a -> 0 (0,0: lowest rank), b -> 1, c -> 1 (3 < 5), d -> 1 (4 < 5), e -> 0 (5 < 8)
    assert owned == [["a", "e"], ["b", "c", "d"]] and load == [5, 8]
    owned, load = ranks.deal([], 3)
    assert owned == [(), (), ()] and load == [0, 0, 0]


def test_outside_a_worker_it_is_worker_zero_of_one():
    assert ranks.worker() == (0, 1)
