"""A resume state names the pack it was saved over (readers/_pack_identity.py): a dataset re-packed
at the same path (pack --force) from other images of the same count and classes is refused,
naming both packs, for every order; a state saved before fingerprints named the pack is refused
saying what to do, and loads once the user names the pack in it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import readers
from packer import pack
from readers import WDSDataset, make_loader

from conftest import sample_ids, tree

ORDERS = {"random": "lmdb", "block": "hdf5", "stream": "wds"}


def loader_of(out: Path, order: str):
    if order == "stream":
        return make_loader(WDSDataset(out, decode="raw", shuffle=4, seed=1), 2, workers=0, collate_fn=sample_ids)
    data = readers.LMDBDataset(out, decode="raw") if order == "random" else readers.HDF5Dataset(out, decode="raw")
    return make_loader(data, 2, workers=0, seed=1, order=order, block_size=2, window=2, collate_fn=sample_ids)


def saved(loader) -> dict:
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    del batches
    return json.loads(json.dumps(state))


def part_of(state: dict) -> dict:
    return state["dataset"] if state["dataset"] is not None else state["sampler"]


@pytest.mark.parametrize("order", ORDERS)
def test_a_state_is_refused_over_a_repack_of_other_images_with_the_same_count_and_classes(tmp_path, order):
    fmt, out = ORDERS[order], tmp_path / f"d.{ORDERS[order]}"
    pack(str(tree(tmp_path / "a", 12, seed=0)), fmt, str(out), workers=1, progress=False)
    state = saved(loader_of(out, order))
    first = part_of(state)["dataset"]
    pack(str(tree(tmp_path / "b", 12, seed=100)), fmt, str(out), workers=1, progress=False, force=True)
    again = loader_of(out, order)
    now = part_of(again.state_dict())["dataset"]
    assert first.split(", packed ")[0] == now.split(", packed ")[0]  # the shape alone cannot tell them apart
    with pytest.raises(ValueError, match="saved with a different dataset") as refused:
        again.load_state_dict(state)
    assert first in str(refused.value) and now in str(refused.value)
    fresh = loader_of(out, order)
    fresh.load_state_dict(fresh.state_dict())  # the same pack's state loads


@pytest.mark.parametrize("order", ORDERS)
def test_a_state_saved_before_states_named_their_pack_is_refused_saying_what_to_do(tmp_path, order):
    fmt, out = ORDERS[order], tmp_path / f"d.{ORDERS[order]}"
    pack(str(tree(tmp_path / "a", 12)), fmt, str(out), workers=1, progress=False)
    state = saved(loader_of(out, order))
    name = part_of(state)["dataset"]
    shape, _, pack_part = name.partition(", packed ")
    assert pack_part
    part_of(state)["dataset"] = shape  # what an earlier packer saved
    with pytest.raises(ValueError, match="without the pack \\(saved before states named it\\).*set the state's "
                                         "\"dataset\" to this pack's name"):
        loader_of(out, order).load_state_dict(state)
    part_of(state)["dataset"] = name  # the user's word that it is this pack
    resumed = loader_of(out, order)
    resumed.load_state_dict(state)
    assert list(resumed)
