"""What a resume state may make readers allocate (readers/_state_limits.py, docs/resume.md): real
saved states, edited as an attacker would, are refused with a ValueError naming the field before
anything is built from them; and a fuzz run over many random edits of real states of every order,
through every way a state is loaded, each loaded within 1 s and 100 MB or refused with ValueError.

The fuzz runs in a fresh interpreter (this file as a script: `python tests/test_state_limits.py
fuzz JOBFILE`), whose address space is capped, so that a state that did allocate without bound
fails the run instead of the machine.
"""
from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers
sys.path.insert(0, str(HERE))

import readers  # noqa: E402
from readers import BlockShuffleSampler, ShuffleSampler, WDSDataset, for_workers, make_loader  # noqa: E402
from readers._state_limits import MAX_HISTORY, MAX_WORKERS, MAX_WORLD_SIZE  # noqa: E402

from conftest import packed_three_ways, sample_ids  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

BATCH, SEED = 5, 3
ORDERS = ("random", "block", "stream")  # over LMDB (shuffled storage), HDF5, WDS shards


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    return packed_three_ways(tmp_path_factory.mktemp("limits"))


def loader_of(root: str, order: str, rank: int = 0, world_size: int = 1, workers: int = 0):
    """make_loader's loader over the order's pack, on rank of world_size."""
    root = Path(root)
    if order == "stream":
        data = WDSDataset(root / "d.wds", decode="raw", shuffle=16, seed=SEED, rank=rank, world_size=world_size)
        return make_loader(data, BATCH, workers=workers, collate_fn=sample_ids, drop_last=False)
    data = (readers.LMDBDataset(root / "d.lmdb", decode="raw") if order == "random"
            else readers.HDF5Dataset(root / "d.h5", decode="raw"))
    loader = make_loader(data, BATCH, workers=workers, seed=SEED, order=order, block_size=4, window=3,
                         collate_fn=sample_ids, drop_last=False)
    loader.sampler.rank, loader.sampler.world_size = rank, world_size
    return loader


def saved(loader, take: int = 2) -> dict:
    """The loader's state after `take` batches, as a checkpoint holds it (through JSON)."""
    batches = iter(loader)
    for _ in range(take):
        next(batches)
    state = loader.state_dict()
    del batches
    return json.loads(json.dumps(state))


def elastic_stream_state(root: str) -> dict:
    """A stream state saved on 3 ranks after a resume from 2: its position holds a history."""
    loader = loader_of(root, "stream", 0, 3)
    loader.load_state_dict(saved(loader_of(root, "stream", 0, 2)))
    state = saved(loader, 1)
    assert state["dataset"]["position"]["history"]
    return state


def sdl_state(root: str, order: str, workers: int, take: int = 2) -> dict:
    """Rank 0 of 2's StatefulDataLoader state over the order after `take` batches."""
    loader, ordered = sdl_loader(root, order, workers, 0, 2)
    ordered.set_epoch(0)
    batches = iter(loader)
    for _ in range(take):
        next(batches)
    state = loader.state_dict()
    del batches
    return json.loads(json.dumps(state))


def sdl_loader(root: str, order: str, workers: int, rank: int = 0, world_size: int = 1):
    from torchdata.stateful_dataloader import StatefulDataLoader

    root = Path(root)
    if order == "stream":
        data = WDSDataset(root / "d.wds", decode="raw", shuffle=16, seed=SEED, rank=rank, world_size=world_size)
        ordered, sampler = data, None
    elif order == "random":
        data = readers.LMDBDataset(root / "d.lmdb", decode="raw")
        ordered = sampler = ShuffleSampler(data, seed=SEED, rank=rank, world_size=world_size)
    else:
        data = readers.HDF5Dataset(root / "d.h5", decode="raw")
        ordered = sampler = BlockShuffleSampler(data, block_size=4, window=3, seed=SEED, rank=rank,
                                                world_size=world_size)
    return StatefulDataLoader(data, BATCH, sampler=sampler, num_workers=workers, collate_fn=sample_ids,
                              drop_last=False), ordered


def first_batch(loader) -> None:
    """Where a loaded state is used: the next pass's first batch (or its end)."""
    next(iter(loader), None)


# -- The numbers of issue's broken states: each refused, naming the field, before anything is built.

def test_a_stream_state_naming_a_billion_ranks_is_refused_before_dealing_to_them(packs):
    state = elastic_stream_state(packs)
    top = json.loads(json.dumps(state))
    top["dataset"]["world_size"] = 10**9
    with pytest.raises(ValueError, match=f"world_size must be an int >= 1 \\(at most {MAX_WORLD_SIZE}\\), got "
                                         "1000000000"):
        loader_of(packs, "stream", 0, 3).load_state_dict(top)
    deep = json.loads(json.dumps(state))
    deep["dataset"]["position"]["history"][0]["world_size"] = 10**9
    with pytest.raises(ValueError, match=f"each pass of the history .* world_size at most {MAX_WORLD_SIZE}"):
        loader_of(packs, "stream", 0, 3).load_state_dict(deep)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):  # what StatefulDataLoader calls
        WDSDataset(Path(packs) / "d.wds", shuffle=16, seed=SEED).load_state_dict(top["dataset"])


def test_a_billion_ranks_in_a_worker_state_is_refused_by_for_workers(packs):
    state = sdl_state(packs, "stream", 2)
    for snapshot in state["_snapshot"]["_worker_snapshots"].values():
        snapshot["dataset_state"]["world_size"] = 10**9
    with pytest.raises(ValueError, match="for_workers: a WDSDataset state's: world_size must be an int >= 1"):
        for_workers(state, 3)


def test_a_position_naming_a_trillion_workers_is_refused(packs):
    state = saved(loader_of(packs, "stream", 0, 2))
    state["dataset"]["position"]["workers"] = 10**12
    with pytest.raises(ValueError, match=f"position's: workers must be an int >= 1 \\(at most {MAX_WORKERS}\\)"):
        loader_of(packs, "stream", 0, 3).load_state_dict(state)


def test_for_workers_refuses_a_billion_saved_workers(packs):
    state = sdl_state(packs, "random", 2)
    state["_snapshot"]["_main_snapshot"]["_num_workers"] = 10**9
    with pytest.raises(ValueError, match=f"_num_workers must be an int >= 0 \\(at most {MAX_WORKERS}\\)"):
        for_workers(state, 3)
    with pytest.raises(ValueError, match=f"num_workers must be an int >= 0 \\(at most {MAX_WORKERS}\\)"):
        for_workers(state, 10**9)


def test_a_history_longer_than_a_run_makes_is_refused_and_one_at_the_bound_resumes(packs):
    state = elastic_stream_state(packs)
    history = state["dataset"]["position"]["history"]
    long = json.loads(json.dumps(state))
    long["dataset"]["position"]["history"] = history * 1000
    with pytest.raises(ValueError, match=f"history holds 1000 passes, over the {MAX_HISTORY} a state may hold"):
        loader_of(packs, "stream", 0, 3).load_state_dict(long)
    full = json.loads(json.dumps(state))
    idle = {**history[0], "batches": 0}  # a pass saved before its first batch: it consumed nothing
    full["dataset"]["position"]["history"] = history + [idle] * (MAX_HISTORY - 1)
    same = loader_of(packs, "stream", 0, 3)
    same.load_state_dict(full)
    assert list(same) == list(loader_of_state(packs, state, 3))  # on its own ranks, it adds no pass
    other = loader_of(packs, "stream", 0, 2)
    other.load_state_dict(full)
    with pytest.raises(ValueError, match=f"resumed on other ranks or workers {MAX_HISTORY} times.*resume it on the "
                                         "3 rank\\(s\\) with 1 DataLoader worker\\(s\\) it was saved on"):
        first_batch(other)


def loader_of_state(root: str, state: dict, world_size: int):
    loader = loader_of(root, "stream", 0, world_size)
    loader.load_state_dict(json.loads(json.dumps(state)))
    return loader


# -- Late or foreign errors: a ValueError at load, naming the field.

def test_a_sampler_part_that_is_not_a_dict_is_refused(packs):
    state = saved(loader_of(packs, "random"))
    state["sampler"] = "ShuffleSampler"
    with pytest.raises(ValueError, match="the sampler state must be a dict .* got str"):
        loader_of(packs, "random").load_state_dict(state)


@pytest.mark.parametrize("order", ORDERS)
def test_an_epoch_past_2_to_the_32_is_refused_at_load_not_at_the_first_batch(packs, order):
    state = saved(loader_of(packs, order))
    part = "dataset" if order == "stream" else "sampler"
    state["epoch"] = state[part]["epoch"] = 2**70
    with pytest.raises(ValueError, match="epoch must be an int >= 0 \\(at most 4294967295\\), got 1180591620717411303424"):
        loader_of(packs, order).load_state_dict(state)
    with pytest.raises(ValueError, match="epoch must be an int >= 0 \\(at most 4294967295\\)"):
        (loader_of(packs, order).dataset if order == "stream" else loader_of(packs, order).sampler
         ).load_state_dict(state[part])


def nested(depth: int, leaf=0):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_deep_json_is_refused_before_it_is_copied_or_printed(packs):
    state = sdl_state(packs, "random", 2)
    state["_snapshot"]["_main_snapshot"]["_sampler_iter_state"] = nested(500)
    with pytest.raises(ValueError, match="for_workers: the state nests lists or dicts over 24 deep"):
        for_workers(state, 3)
    stream = elastic_stream_state(packs)
    stream["dataset"]["position"]["history"][0]["batches"] = nested(100_000)
    with pytest.raises(ValueError, match="EpochLoader.load_state_dict: the state nests lists or dicts over 24 deep"):
        loader_of(packs, "stream", 0, 3).load_state_dict(stream)
    with pytest.raises(ValueError, match="WDSDataset.load_state_dict: the state nests"):
        WDSDataset(Path(packs) / "d.wds", shuffle=16, seed=SEED).load_state_dict(stream["dataset"])


def test_an_error_quotes_a_huge_value_in_a_few_hundred_characters(packs):
    state = saved(loader_of(packs, "stream", 0, 2))
    state["dataset"]["position"]["batch_size"] = "x" * 10**7
    with pytest.raises(ValueError) as refused:
        loader_of(packs, "stream", 0, 3).load_state_dict(state)
    assert len(str(refused.value)) < 1000 and "batch_size" in str(refused.value)
