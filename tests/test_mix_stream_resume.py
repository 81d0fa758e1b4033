"""A stream mixture's elastic and reweighted resume (readers._mix_chains, readers._mix_stream_state):
a state saved on 2 ranks x 2 DataLoader workers resumes on 3 gloo ranks x 1 worker, at the first
batch, mid-way, in the last batch and at the end, with the weights it was saved with and with
others; every sample of each source is counted per epoch: the map-style source's draws go on
along its pass, and no stream sample read before the stop comes again before all of its stream's
epoch is read; and torchdata's StatefulDataLoader state of the 2 x 2 ranks, rewritten by
readers.for_workers, resumes on the 3 x 1 the same way. Ranks are separate processes
(tests/test_elastic.py's launch; rank 0 of the 2 is the test's own) running this file as a
script: `python tests/test_mix_stream_resume.py JOBFILE`.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers

import readers  # noqa: E402
from readers import Mix, make_loader  # noqa: E402

from conftest import goes_on, packed_three_ways, sample_ids  # noqa: E402
from test_elastic import flat, interleaved, rank_main, run_ranks, stops  # noqa: E402

BATCH, SEED, EPOCH = 5, 3, 100
WEIGHTS, NEW = {"lmdb": 0.7, "web": 0.3}, {"lmdb": 0.2, "web": 0.8}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    return packed_three_ways(tmp_path_factory.mktemp("mixstreamresume"))


def mixture(root: str, weights: dict = WEIGHTS, reweight: bool = False, rank=None, world_size=None) -> Mix:
    root = Path(root)
    return Mix({"lmdb": readers.LMDBDataset(root / "d.lmdb", decode="raw"),
                "web": readers.WDSDataset(root / "d.wds", decode="raw", shuffle=4, seed=SEED, rank=rank,
                                          world_size=world_size)},
               weights=weights, seed=SEED, epoch_size=EPOCH, reweight=reweight)


def loader_of(mix: Mix, workers: int):
    return make_loader(mix, BATCH, workers=workers, seed=SEED, collate_fn=sample_ids, drop_last=False)


def ids(root: str) -> dict[str, set[int]]:
    """Every sample id (conftest.sample_ids's) each source can give: the packs hold the same images."""
    images = [image for image, _ in readers.LMDBDataset(Path(root) / "d.lmdb", decode="raw")]
    return {name: set(sample_ids([(image, 0, s) for image in images])) for s, name in enumerate(("lmdb", "web"))}


def lmdb_pass(root: str) -> list[int]:
    """The LMDB source's draws in order, 3 passes: a mixture of it alone draws them."""
    root = Path(root)
    alone = Mix({"lmdb": readers.LMDBDataset(root / "d.lmdb", decode="raw"),
                 "hdf5": readers.HDF5Dataset(root / "d.h5", decode="raw")},
                weights={"lmdb": 1.0, "hdf5": 0.0}, seed=SEED, epoch_size=300)
    return flat(loader_of(alone, 0))


def stateful_of(root: str, workers: int):
    """(torchdata's StatefulDataLoader over the mixture, the mixture, told the batch size)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    mix = mixture(root)
    mix.batching(BATCH, False)
    return StatefulDataLoader(mix, BATCH, num_workers=workers, collate_fn=sample_ids), mix


# Script side
def save_side(job: dict) -> dict:
    """Epochs 0 and 1 whole, and for each stop the batches handed out before rank 0's state."""
    loader = loader_of(mixture(job["root"]), job["workers"])
    full = [list(loader), list(loader)]
    heads = {}
    for k in stops(len(full[0])):
        loader = loader_of(mixture(job["root"]), job["workers"])
        batches = iter(loader)
        heads[k] = [next(batches) for _ in range(k)]
        state = loader.state_dict()
        del batches
        if job["rank"] == 0:
            torch.save(state, Path(job["folder"]) / f"mixstream-{k}.pt")
    loader, mix = stateful_of(job["root"], job["workers"])
    mix.set_epoch(0)
    batches = iter(loader)
    stateful = [next(batches) for _ in range(3)]  # inside a round of the workers' batches
    if job["rank"] == 0:
        torch.save(loader.state_dict(), Path(job["folder"]) / "stateful.pt")
    del batches
    return {"mix": {"full": full, "heads": heads, "stateful": stateful}}


def resume_side(job: dict) -> dict:
    """Per stop: the rest of the epoch and the next, with the saved weights and with NEW."""
    record: dict = {"same": {}, "new": {}}
    for path in Path(job["states"]).glob("mixstream-*.pt"):
        k = int(path.stem.rpartition("-")[2])
        for case, mix in (("same", mixture(job["root"])), ("new", mixture(job["root"], NEW, reweight=True))):
            loader = loader_of(mix, job["workers"])
            loader.load_state_dict(torch.load(path, weights_only=True))
            record[case][k] = [list(loader), list(loader)]
    loader, mix = stateful_of(job["root"], job["workers"])
    state = torch.load(Path(job["states"]) / "stateful.pt", weights_only=True)
    loader.load_state_dict(readers.for_workers(state, job["workers"], dataset=mix))
    record["stateful"] = []
    for epoch in range(2):
        mix.set_epoch(epoch)
        record["stateful"].append(list(loader))
    return {"mix": record}


PHASES = {"save": save_side, "resume": resume_side}


# Test side
@pytest.fixture(scope="module")
def rank_runs(packs, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("runs")
    here = sys.modules[__name__]
    saved = run_ranks("save", folder, packs, world_size=2, workers=2, script=here)
    resumed = run_ranks("resume", folder, packs, world_size=3, workers=1, gloo=True, script=here)
    return {"saved": [r["mix"] for r in saved], "resumed": [r["mix"] for r in resumed]}


def by_source(samples: list[int], known: dict[str, set[int]]) -> dict[str, list[int]]:
    assert all(s in known["lmdb"] or s in known["web"] for s in samples)
    return {name: [s for s in samples if s in known[name]] for name in known}


def test_a_stream_mixture_resumes_on_other_ranks_and_workers(rank_runs, packs):
    saved, resumed, known, along = rank_runs["saved"], rank_runs["resumed"], ids(packs), lmdb_pass(packs)
    epochs = [by_source(flat(b for r in saved for b in r["full"][e]), known) for e in range(2)]
    assert [len(e["lmdb"]) for e in epochs] == [70, 70] and [len(e["web"]) for e in epochs] == [30, 30]
    for k in stops(len(saved[0]["full"][0])):
        where = f"2x2 -> 3x1 after {k} batches"
        head = by_source(flat(b for r in saved for b in r["heads"][str(k)]), known)
        rests = [r["same"][str(k)][0] for r in resumed]
        assert len({len(b) for b in rests}) == 1, f"{where}: ranks make different batch counts"
        rest = by_source(interleaved([flat(b) for b in rests]), known)
        after = by_source(flat(b for r in resumed for b in r["same"][str(k)][1]), known)
        if k == len(saved[0]["full"][0]):  # the epoch was over: the resume starts epoch 1
            assert set(rest["lmdb"]) == set(epochs[1]["lmdb"]) and len(rest["lmdb"]) - 70 < 3, where
        else:
            lmdb = head["lmdb"] + rest["lmdb"]
            assert set(lmdb) == set(epochs[0]["lmdb"]) and len(lmdb) - 70 < 3, f"{where}: the epoch's lmdb draws"
            assert set(after["lmdb"]) == set(epochs[1]["lmdb"]) and len(after["lmdb"]) - 70 < 3, f"{where}: epoch 1"
            assert 30 <= len(head["web"]) + len(rest["web"]) < 33, where
        web = head["web"] + rest["web"] + after["web"]  # under 100: every chain is in the stream's first epoch
        assert len(web) - len(set(web)) < 3 * 2, f"{where}: a stream sample read twice (beyond the padding)"
        assert not set(head["web"]) & set(rest["web"] + after["web"]), f"{where}: read before the stop, again"


def test_a_stream_mixtures_torchdata_state_resumes_on_other_ranks_and_workers(rank_runs, packs):
    saved, resumed, known = rank_runs["saved"], rank_runs["resumed"], ids(packs)
    epochs = [by_source(flat(b for r in saved for b in r["full"][e]), known) for e in range(2)]
    head = by_source(flat(b for r in saved for b in r["stateful"]), known)
    rests = [r["stateful"][0] for r in resumed]
    assert len({len(b) for b in rests}) == 1, "ranks make different batch counts"
    rest = by_source(interleaved([flat(b) for b in rests]), known)
    after = by_source(flat(b for r in resumed for b in r["stateful"][1]), known)
    lmdb = head["lmdb"] + rest["lmdb"]
    assert set(lmdb) == set(epochs[0]["lmdb"]) and len(lmdb) - 70 < 3, "the epoch's lmdb draws"
    assert set(after["lmdb"]) == set(epochs[1]["lmdb"]) and len(after["lmdb"]) - 70 < 3, "epoch 1's"
    assert 30 <= len(head["web"]) + len(rest["web"]) < 33
    web = head["web"] + rest["web"] + after["web"]  # under 100: every chain is in the stream's first epoch
    assert len(web) - len(set(web)) < 3 * 2, "a stream sample read twice (beyond the padding)"
    assert not set(head["web"]) & set(rest["web"] + after["web"]), "read before the stop, again"


def test_a_stream_mixture_resumes_with_new_weights_on_other_ranks_and_workers(rank_runs, packs):
    saved, resumed, known, along = rank_runs["saved"], rank_runs["resumed"], ids(packs), lmdb_pass(packs)
    for k in stops(len(saved[0]["full"][0])):
        where = f"new weights after {k} batches"
        head = by_source(flat(b for r in saved for b in r["heads"][str(k)]), known)
        left = EPOCH - len(head["lmdb"]) - len(head["web"]) or EPOCH  # at the end: the next epoch
        rest = by_source(interleaved([flat(b) for r in resumed for b in [r["new"][str(k)][0]]])[:left], known)
        after = by_source(interleaved([flat(r["new"][str(k)][1]) for r in resumed])[:EPOCH], known)
        assert abs(len(rest["web"]) - 0.8 * left) <= 2, f"{where}: the rest follows the new weights"
        assert (len(after["lmdb"]), len(after["web"])) == (20, 80), f"{where}: the next epoch too"
        assert goes_on([head["lmdb"], rest["lmdb"], after["lmdb"]], along), f"{where}: lmdb's pass stopped"
        unread = known["web"] - set(head["web"])
        share = math.ceil(len(unread) / 3)
        for r in resumed:  # one worker a rank: a rank's stream draws are its chain's, in order
            chain = by_source(flat(r["new"][str(k)][0] + r["new"][str(k)][1]), known)["web"][:share]
            assert len(set(chain)) == len(chain) and not set(chain) & set(head["web"]), where
            unread -= set(chain)
        assert not unread, f"{where}: the stream's epoch is read whole before it starts again"


if __name__ == "__main__":
    rank_main(PHASES)
