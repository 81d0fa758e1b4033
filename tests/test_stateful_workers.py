"""readers.for_workers (readers/stateful_workers.py): a torchdata StatefulDataLoader state saved
with K1 DataLoader workers, rewritten for K2 and loaded on another number of ranks, resumes as
docs/resume.md says: the rest of the epoch is the samples no rank had handed out, each once (at
most W2 - 1 repeats), in equal batch counts, then the epochs a fresh W2 x K2 run reads.

Ranks are separate processes told RANK and WORLD_SIZE, each with real DataLoader workers (rank 0
is the test's own process), run by tests/test_elastic.py's launch and checked by its
check_resumes; rank 0 saves the one state. The processes run this file as a script:
`python tests/test_stateful_workers.py JOBFILE`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers
sys.path.insert(0, str(HERE))

import readers  # noqa: E402
from readers import BlockShuffleSampler, ShuffleSampler, WDSDataset, for_workers, make_loader  # noqa: E402

from conftest import packed_three_ways, sample_ids  # noqa: E402
from test_elastic import (BATCH, SEED, Step, check_resumes, epoch_of, flat, launch, rank_main, run_ranks,  # noqa: E402
                          save_heads, save_to_bytes)

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]  # 3 workers, 2 cores

CASES = ("sdl-random", "sdl-block", "sdl-stream")  # over LMDB (shuffled storage), HDF5, WDS shards


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    return packed_three_ways(tmp_path_factory.mktemp("workers"))


def stateful(root: str, case: str, workers: int, rank: int | None = None, world_size: int | None = None,
             snapshot_every: int = 1, drop_last: bool = False):
    """(a StatefulDataLoader with `workers` workers over the case's order, what set_epoch is called on)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    root = Path(root)
    if case == "sdl-stream":
        data = WDSDataset(root / "d.wds", decode="raw", shuffle=16, seed=SEED, rank=rank, world_size=world_size)
        ordered, sampler = data, None
    elif case == "sdl-random":
        data = readers.LMDBDataset(root / "d.lmdb", decode="raw")
        ordered = sampler = ShuffleSampler(data, seed=SEED, rank=rank, world_size=world_size)
    else:
        data = readers.HDF5Dataset(root / "d.h5", decode="raw")
        ordered = sampler = BlockShuffleSampler(data, block_size=4, window=3, seed=SEED, rank=rank,
                                                world_size=world_size)
    return StatefulDataLoader(data, BATCH, sampler=sampler, num_workers=workers, collate_fn=sample_ids,
                              snapshot_every_n_steps=snapshot_every, drop_last=drop_last), ordered


def save_side(job: dict) -> dict:
    """Per case: a whole epoch 0 and, for each stop, the batches handed out before rank 0's state."""
    def at_epoch_zero(case: str):
        loader, ordered = stateful(job["root"], case, job["workers"])
        ordered.set_epoch(0)
        return loader

    return save_heads(job, CASES, at_epoch_zero)


def resume_side(job: dict) -> dict:
    """Per case and stop: the rest of epoch 0 from rank 0's state rewritten for this run's
    workers (through json, so it is plain), then epoch 1; and a fresh run's epochs 0 and 1."""
    record = {}
    for case in CASES:
        loader, ordered = stateful(job["root"], case, job["workers"])
        record[case] = {"fresh": [epoch_of(loader, ordered, 0), epoch_of(loader, ordered, 1)]}
        for path in Path(job["states"]).glob(f"{case}-*.pt"):
            state = for_workers(torch.load(path, weights_only=True), job["workers"])
            loader, ordered = stateful(job["root"], case, job["workers"])
            loader.load_state_dict(json.loads(json.dumps(state)))
            record[case][int(path.stem.rpartition("-")[2])] = [epoch_of(loader, ordered, 0),
                                                               epoch_of(loader, ordered, 1)]
    return record


PHASES = {"save": save_side, "resume": resume_side}


@pytest.fixture(scope="module")
def rank_runs(packs, tmp_path_factory) -> dict:
    """The rank launches of the two tests below, {launch: each rank's record}: 3 ranks without
    workers resume the 2 x 2 state and then save their own, then resume the 2 x 2 state with one
    worker each, in the same processes."""
    a, b = tmp_path_factory.mktemp("from2x2"), tmp_path_factory.mktemp("from3x0")
    here = sys.modules[__name__]
    runs = {"save 2x2": run_ranks("save", a, packs, world_size=2, workers=2, script=here)}
    runs["resume 3x0, save 3x0"], runs["resume 3x1"] = launch(packs, 3, [Step("resume+save", b, 0, states=a),
                                                                        Step("resume", b, 1, states=a)], script=here)
    runs["resume 1x3"] = run_ranks("resume", a, packs, world_size=1, workers=3, script=here)
    runs["resume 2x2"] = run_ranks("resume", b, packs, world_size=2, workers=2, script=here)
    return runs


def test_a_state_saved_with_two_workers_resumes_with_none_one_or_three_on_other_ranks(rank_runs):
    for world_size, workers in ((3, 0), (1, 3), (3, 1)):
        resumed = rank_runs["resume 3x0, save 3x0" if world_size == 3 and not workers else
                            f"resume {world_size}x{workers}"]
        check_resumes(rank_runs["save 2x2"], resumed, f"2x2 -> {world_size}x{workers}", CASES)


def test_a_state_saved_without_workers_resumes_with_two_on_other_ranks(rank_runs):
    check_resumes(rank_runs["resume 3x0, save 3x0"], rank_runs["resume 2x2"], "3x0 -> 2x2", CASES)


@pytest.mark.parametrize("case", CASES)
def test_a_state_saved_after_a_rewritten_resume_is_rewritten_and_resumes_again(packs, case):
    """2 ranks x 2 workers -> 3 x 3 (rank 0's state saved mid-way) -> 1 x 0: every sample once."""
    handed, state = [], None
    for world_size, workers, take in ((2, 2, 3), (3, 3, 2)):
        for rank in range(world_size):
            loader, ordered = stateful(packs, case, workers, rank, world_size)
            if state is not None:
                loader.load_state_dict(for_workers(state, workers))
            ordered.set_epoch(0)
            batches = iter(loader)
            handed += flat(next(batches) for _ in range(take))
            saved = loader.state_dict() if rank == 0 else saved
            del batches
        state = saved
    loader, ordered = stateful(packs, case, 0, 0, 1)
    loader.load_state_dict(for_workers(torch.load(save_to_bytes(state), weights_only=True), 0))
    rest = flat(epoch_of(loader, ordered, 0))
    assert sorted(set(handed) | set(rest)) == sorted(set(flat(stateful(packs, case, 0, 0, 1)[0])))
    assert not set(handed) & set(rest) and len(rest) == len(set(rest))
    assert len(handed) - len(set(handed)) < 3  # 3 ranks pad with 2 repeats at most


def stream_state(packs, workers: int, take: int = 3, snapshot_every: int = 1) -> dict:
    """Rank 0 of 2's StatefulDataLoader state over the stream after `take` batches."""
    loader, data = stateful(packs, "sdl-stream", workers, 0, 2, snapshot_every)
    data.set_epoch(0)
    batches = iter(loader)
    for _ in range(take):
        next(batches)
    return loader.state_dict()


def without_base_seed(state: dict) -> dict:
    state = json.loads(json.dumps(state))
    del state["_snapshot"]["_main_snapshot"]["_base_seed"]  # workers are seeded afresh
    return state


def test_the_same_worker_count_returns_the_state_and_another_is_plain_and_the_same_by_any_way(packs):
    state = stream_state(packs, 2)
    assert for_workers(state, 2) is state
    three = for_workers(state, 3)
    assert torch.load(save_to_bytes(three), weights_only=True) == three == json.loads(json.dumps(three))
    assert len(json.dumps(three)) < 4000
    assert without_base_seed(for_workers(for_workers(state, 0), 3)) == without_base_seed(three)
    # On the saving world: both ranks, 3 workers each, read the rest, each sample once (a repeat at most).
    handed = {s for rank in range(2) for s in flat(list(stateful(packs, "sdl-stream", 2, rank, 2)[0])[:3])}
    rests = []
    for rank in range(2):
        loader, _ = stateful(packs, "sdl-stream", 3, rank, 2)
        loader.load_state_dict(three)
        rests.append(flat(list(loader)))
    assert len(rests[0]) == len(rests[1])
    assert handed | set(rests[0] + rests[1]) == set(flat(stateful(packs, "sdl-stream", 0)[0]))
    assert not handed & set(rests[0] + rests[1]) and len(rests[0] + rests[1]) - len(set(rests[0] + rests[1])) < 2


def test_what_cannot_be_rewritten_is_refused_saying_what_to_do(packs):
    state = stream_state(packs, 2)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        for_workers(state, -1)
    with pytest.raises(ValueError, match="not a StatefulDataLoader state of torchdata 0.11 .*pass the dict"):
        for_workers({"epoch": 0, "position": 3}, 1)
    with pytest.raises(ValueError, match="not a StatefulDataLoader state"):
        for_workers([state], 1)
    loader = make_loader(readers.LMDBDataset(Path(packs) / "d.lmdb", decode="raw"), BATCH, workers=0, seed=SEED)
    with pytest.raises(ValueError, match="make_loader's loader state, which resumes with any number of workers"):
        for_workers(loader.state_dict(), 2)
    lost = json.loads(json.dumps(state))
    del lost["_snapshot"]["_worker_snapshots"]["worker_1"]
    with pytest.raises(ValueError, match="_worker_snapshots are not one dict .* for each of its 2 workers"):
        for_workers(lost, 3)
    other = json.loads(json.dumps(state))
    for snapshot in other["_snapshot"]["_worker_snapshots"].values():
        snapshot["dataset_state"]["kind"] = "MyStream"
    with pytest.raises(ValueError, match="IterableDataset other than readers.WDSDataset"):
        for_workers(other, 3)
    mixed = json.loads(json.dumps(state))
    mixed["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]["epoch"] = 4
    with pytest.raises(ValueError, match="differ in more than their position"):
        for_workers(mixed, 0)
    between = stream_state(packs, 2, take=3, snapshot_every=2)
    assert between["_steps_since_snapshot"] == 1
    with pytest.raises(ValueError, match="1 batch\\(es\\) after StatefulDataLoader's last snapshot.*keep the default"):
        for_workers(between, 3)


if __name__ == "__main__":
    rank_main(PHASES)
