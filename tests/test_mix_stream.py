"""Mixtures with a WebDataset stream (readers.mix_stream): real shards read by real DataLoader
workers through make_loader and a plain DataLoader; each source's share of every batch; every
map-style sample once per pass and no stream sample twice before its stream's epoch is read;
the same batches after a resume on the ranks and workers that saved it (the map-style
sources' exactly, and each stream going on where it stopped), through thread workers and
torchdata's StatefulDataLoader too, whose workers' states readers.for_workers pools for other
workers and ranks; a state resumed on other workers and saved again; and
clear refusals of a foreign or damaged state and of what a stream mixture does not do
(tests/test_mix_stream_resume.py resumes on other gloo ranks).
"""
from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path

import pytest
import torch.utils.data as tud

import readers
from readers import Mix, make_loader
from readers.mix_stream import MixStream

from conftest import packed_three_ways, sample_ids

BATCH, SEED, EPOCH = 10, 3, 100
WEIGHTS = {"lmdb": 0.7, "web": 0.3}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    return Path(packed_three_ways(tmp_path_factory.mktemp("mixstream")))


def mixture(packs: Path, shuffle: int = 4) -> MixStream:
    return Mix({"lmdb": readers.LMDBDataset(packs / "d.lmdb", decode="raw"),
                "web": readers.WDSDataset(packs / "d.wds", decode="raw", shuffle=shuffle, seed=SEED)},
               weights=WEIGHTS, seed=SEED, epoch_size=EPOCH)


def ids_of(packs: Path, source: int) -> set[int]:
    """Every sample id (conftest.sample_ids's) a source can give: the packs hold the same images."""
    return {zlib.crc32(bytes(image), source + 1) for image, _ in readers.LMDBDataset(packs / "d.lmdb", decode="raw")}


def split(batches: list[list[int]], packs: Path) -> tuple[list[int], list[int]]:
    """(the lmdb source's ids, the stream's) in the order handed out."""
    lmdb, web = ids_of(packs, 0), ids_of(packs, 1)
    flat = [i for batch in batches for i in batch]
    assert all(i in lmdb or i in web for i in flat)
    return [i for i in flat if i in lmdb], [i for i in flat if i in web]


def loader_of(mix, workers: int = 2):
    return make_loader(mix, BATCH, workers=workers, seed=SEED, collate_fn=sample_ids, drop_last=False)


def epochs(loader, count: int) -> list[list[int]]:
    return [batch for _ in range(count) for batch in loader]


def refused_by_workers(loader, error: type, match: str) -> None:
    """A pass of loader raises error, matching match, from its workers. torch raises a worker's
    error again from a frame that holds it, a reference cycle that would keep the workers until a
    garbage collection, whose shutdown of them waits out a timeout per worker: the cycle is broken
    here, so they stop now."""
    batches = iter(loader)
    with pytest.raises(error, match=match) as refused:
        list(batches)
    refused.value.__traceback__ = None
    del refused, batches


def test_a_stream_source_makes_the_mixture_an_iterable_dataset_of_both(packs):
    mix = mixture(packs)
    assert isinstance(mix, MixStream) and isinstance(mix, tud.IterableDataset)
    assert mix.names == ["lmdb", "web"] and mix.classes == ["class0", "class1", "class2", "class3"]
    batches = epochs(loader_of(mix), 3)
    assert len(batches) == 30 and all(len(b) == BATCH for b in batches)
    lmdb, web = split(batches, packs)
    shares = [sum(i in set(lmdb) for i in batch) for batch in batches]
    assert all(6 <= n <= 8 for n in shares), shares  # 0.7 of 10, within 1
    assert len(lmdb) == 210 and len(web) == 90
    assert set(lmdb[:100]) == ids_of(packs, 0) and set(lmdb[100:200]) == ids_of(packs, 0)  # whole passes
    assert len(set(web)) == 90, "no stream sample twice before the stream's epoch is read"


def test_the_stream_goes_on_across_the_mixtures_epochs_through_its_own(packs):
    mix = mixture(packs, shuffle=0)
    _, web = split(epochs(loader_of(mix), 5), packs)  # 150 stream draws: each worker's run of 50, three times
    assert len(web) == 150 and set(web) == ids_of(packs, 1)
    counts = sorted(web.count(i) for i in set(web))
    assert counts[0] >= 1 and counts[-1] <= 2


def test_a_plain_dataloader_makes_the_same_batches_once_told_the_batch_size(packs):
    expected = epochs(loader_of(mixture(packs)), 2)
    mix = mixture(packs)
    loader = tud.DataLoader(mix, batch_size=BATCH, num_workers=2, collate_fn=sample_ids)
    refused_by_workers(loader, ValueError, r"call mix.batching\(batch_size, drop_last\)")
    mix.batching(BATCH, False)
    got = []
    for epoch in range(2):
        mix.set_epoch(epoch)
        got.extend(loader)
    assert got == expected


def test_spawned_workers_and_thread_workers_make_the_same_batches(packs):
    expected = epochs(loader_of(mixture(packs)), 1)
    spawned = make_loader(mixture(packs), BATCH, workers=2, seed=SEED, collate_fn=sample_ids, drop_last=False,
                          multiprocessing_context="spawn")
    threads = make_loader(mixture(packs), BATCH, workers=2, seed=SEED, collate_fn=sample_ids, drop_last=False,
                          worker_kind="threads")
    assert list(spawned) == expected == list(threads)
    def threaded():
        return make_loader(mixture(packs), BATCH, workers=2, seed=SEED, collate_fn=sample_ids, drop_last=False,
                           worker_kind="threads")

    saving = threaded()
    batches = iter(saving)
    head = [next(batches) for _ in range(4)]
    state = json.loads(json.dumps(saving.state_dict()))
    del batches
    resumed = threaded()
    resumed.load_state_dict(state)
    assert head + list(resumed) == expected, "2 threads resume exactly as 2 workers do"


@pytest.mark.parametrize("take", [4, 3])  # a whole round of the 2 workers' batches, and inside one
def test_a_resume_on_the_same_ranks_and_workers_goes_on_where_it_stopped(packs, take):
    expected = epochs(loader_of(mixture(packs)), 2)
    loader = loader_of(mixture(packs))
    batches = iter(loader)
    before = [next(batches) for _ in range(take)]
    state = json.loads(json.dumps(loader.state_dict()))
    del batches
    resumed = loader_of(mixture(packs))
    resumed.load_state_dict(state)
    after = epochs(resumed, 2)
    assert before == expected[:take] and len(before + after) == len(expected)
    got_lmdb, got_web = split(before + after, packs)
    lmdb, web = split(expected, packs)
    assert got_lmdb == lmdb, "the map-style source's samples are the uninterrupted run's"
    assert len(got_web) == len(web) == len(set(got_web)), "each stream goes on: none read twice"
    if take % 2 == 0:  # each worker makes the batches it made before the stop
        assert before + after == expected


def pull(loader, take: int) -> list:
    """`take` batches, from as many passes as it takes (a resumed epoch's rest may be empty)."""
    out = []
    for _ in range(4):
        for batch in loader:
            out.append(batch)
            if len(out) == take:
                return out
    return out


def test_resuming_twice_and_at_an_epochs_end(packs):
    expected = epochs(loader_of(mixture(packs)), 3)
    loader, handed = loader_of(mixture(packs)), []
    for take in (2, 8, 10, 4):  # inside epoch 0; at its end; at epoch 1's end (saved as epoch 2's start); inside 2
        handed.extend(pull(loader, take))
        state = json.loads(json.dumps(loader.state_dict()))
        loader = loader_of(mixture(packs))
        loader.load_state_dict(state)
    handed.extend(pull(loader, 6))
    assert split(handed, packs)[0] == split(expected, packs)[0]
    assert handed == expected, "every stop fell on a whole round of the workers' batches"


def test_two_ranks_share_the_map_style_sources_and_read_their_own_streams(packs, monkeypatch):
    ranks = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ranks.append(split(epochs(loader_of(mixture(packs)), 1), packs))
    lmdb = ranks[0][0] + ranks[1][0]
    web = ranks[0][1] + ranks[1][1]
    assert sorted(lmdb) == sorted(set(lmdb)) and len(lmdb) == 70
    assert len(web) == 30 == len(set(web))


def stateful(packs: Path, workers: int):
    """(a torchdata StatefulDataLoader over the mixture, the mixture, told the batch size)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    mix = mixture(packs)
    mix.batching(BATCH, False)
    return StatefulDataLoader(mix, BATCH, num_workers=workers, collate_fn=sample_ids), mix


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_resumes_a_stream_mixture_exactly_from_each_workers_own_state(packs, workers):
    loader, mix = stateful(packs, workers)
    expected = []
    for epoch in range(2):
        mix.set_epoch(epoch)
        expected.append(list(loader))
    for take in (3, 10):  # inside a round of the workers' batches, and at the epoch's end
        loader, mix = stateful(packs, workers)
        mix.set_epoch(0)
        batches = iter(loader)
        head = [next(batches) for _ in range(take)]
        state = json.loads(json.dumps(loader.state_dict()))
        del batches
        loader, mix = stateful(packs, workers)
        loader.load_state_dict(state)
        mix.set_epoch(0)
        rest = list(loader)
        mix.set_epoch(1)
        assert head + rest == expected[0] and list(loader) == expected[1], f"{workers} workers, {take} batches"
    worker_state = mixture(packs)
    worker_state.batching(BATCH, False)
    own = worker_state.state_dict()
    own["worker"].update(worker=1, workers=2)
    with pytest.raises(ValueError, match=r"worker 1 of 2's on rank 0 of 1, loaded in worker 0 of 1 .*make_loader"):
        worker_state.load_state_dict(own)


def stopped(packs: Path, workers: int, take: int, state=None) -> tuple[list, dict]:
    """(the batches handed out, the StatefulDataLoader state there, through JSON) of a loader
    over the mixture with `workers`, `take` batches into epoch 0 (from `state`, for_workers'd)."""
    loader, mix = stateful(packs, workers)
    if state is not None:
        loader.load_state_dict(readers.for_workers(state, workers, mix))
    mix.set_epoch(0)
    batches = iter(loader)
    head = [next(batches) for _ in range(take)]
    state = json.loads(json.dumps(loader.state_dict()))
    del batches
    return head, state


def uninterrupted(packs: Path) -> list[tuple[list[int], list[int]]]:
    """Epochs 0 and 1 on 2 workers, split by source."""
    loader, mix = stateful(packs, 2)
    out = []
    for epoch in range(2):
        mix.set_epoch(epoch)
        out.append(split(list(loader), packs))
    return out


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_torchdata_state_of_2_workers_resumes_on_0_1_and_3_through_for_workers(packs):
    expected = uninterrupted(packs)
    head, state = stopped(packs, 2, 3)  # inside a round of the 2 workers' batches
    for workers in (0, 1, 3):
        loader, mix = stateful(packs, workers)
        loader.load_state_dict(readers.for_workers(state, workers, mix))
        mix.set_epoch(0)
        first = split(head + list(loader), packs)
        mix.set_epoch(1)
        second = split(list(loader), packs)
        for (lmdb, web), (lmdb_then, web_then) in zip((first, second), expected):
            assert sorted(lmdb) == sorted(lmdb_then), f"{workers} workers: the map-style source's draws of the epoch"
            assert len(web) == len(web_then), f"{workers} workers: the stream's draws of the epoch"
        web = first[1] + second[1]
        assert len(web) == len(set(web)), f"{workers} workers: a stream sample twice before its epoch is read"


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_a_pooled_state_saved_again_or_at_the_epochs_end_resumes_through_for_workers(packs):
    expected = uninterrupted(packs)
    whole, ended = stopped(packs, 2, EPOCH // BATCH)  # after the epoch's last batch: the next epoch's start
    loader, mix = stateful(packs, 3)
    loader.load_state_dict(readers.for_workers(ended, 3, mix))
    mix.set_epoch(0)
    assert list(loader) == [], "the epoch was over"
    mix.set_epoch(1)
    lmdb, web = split(list(loader), packs)
    assert sorted(lmdb) == sorted(expected[1][0]) and not set(web) & set(split(whole, packs)[1])
    head, state = stopped(packs, 2, 3)
    middle, again = stopped(packs, 3, 2, state)  # inside a round of 3 workers after a resume, then on 1
    loader, mix = stateful(packs, 1)
    loader.load_state_dict(readers.for_workers(again, 1, mix))
    mix.set_epoch(0)
    lmdb, web = split(head + middle + list(loader), packs)
    assert sorted(lmdb) == sorted(expected[0][0]) and len(web) == len(set(web)) == len(expected[0][1])


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_for_workers_refuses_a_damaged_stream_mixture_state_naming_what(packs):
    state, mix = stopped(packs, 2, 3)[1], stateful(packs, 1)[1]
    damaged = [("first", 7, r"next batches \[4, 7\] are not one loader's"),
               ("chains", {"web": -1}, r"chains must hold a count >= 0 for each stream source"),
               ("worker", 0, r"workers 0 to 1 of 2 of one rank's pass")]
    for key, value, refusal in damaged:
        bad = copy.deepcopy(state)
        bad["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]["worker"][key] = value
        with pytest.raises(ValueError, match=refusal):
            readers.for_workers(bad, 1, mix)
    bad = copy.deepcopy(state)
    bad["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]["epoch"] = 1
    with pytest.raises(ValueError, match="differ in more than their own part"):
        readers.for_workers(bad, 1, mix)
    with pytest.raises(ValueError, match="dataset must be the stream mixture .* got LMDBDataset"):
        readers.for_workers(state, 1, readers.LMDBDataset(packs / "d.lmdb", decode="raw"))
    with pytest.raises(ValueError, match=r"for_workers\(state, num_workers, dataset=mix\)"):
        readers.for_workers(state, 3)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_torchdata_states_of_2_ranks_resume_on_1_rank_through_for_workers(packs, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    heads, whole = [], []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        loader, mix = stateful(packs, 2)
        mix.set_epoch(0)
        whole.append(split(list(loader), packs))
        batches = iter(loader)
        heads.append([next(batches) for _ in range(3)])
        state = json.loads(json.dumps(loader.state_dict()))
        del batches
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for workers in (2, 3):  # the workers it was saved with, and others
        loader, mix = stateful(packs, workers)
        loader.load_state_dict(readers.for_workers(state, workers, mix))  # the last rank's state
        mix.set_epoch(0)
        lmdb, web = split(heads[0] + heads[1] + list(loader), packs)
        assert sorted(lmdb) == sorted(whole[0][0] + whole[1][0]), f"{workers} workers: the map-style draws"
        assert len(web) == len(whole[0][1] + whole[1][1]) == len(set(web)), f"{workers} workers: the stream"
    own = state["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]["worker"]
    own["chains"]["web"] += 1  # not where the schedule from its pass's start puts it
    with pytest.raises(ValueError, match=r"the other 1 rank\(s\)' cannot be worked out from one rank's state"):
        readers.for_workers(state, 3, stateful(packs, 3)[1])


def test_what_a_stream_mixture_does_not_do_is_refused_naming_the_fix(packs):
    class Numbers(tud.IterableDataset):
        def __iter__(self):
            return iter([(b"x", 0)])

    with pytest.raises(ValueError, match="source 'numbers' .*Numbers.* IterableDataset other than readers.WDSDataset"):
        Mix({"lmdb": readers.LMDBDataset(packs / "d.lmdb", decode="raw"), "numbers": Numbers()})
    tiny = Mix({"lmdb": readers.LMDBDataset(packs / "d.lmdb", decode="raw"),
                "web": readers.WDSDataset(sorted((packs / "d.wds").rglob("*.tar"))[0], decode="raw")},
               unlabeled=("web",))
    refused_by_workers(loader_of(tiny, workers=10), Exception,
                       "stream source 'web' has 9 samples per rank, fewer than the 10 DataLoader")


def test_a_state_resumes_on_2_then_1_then_3_workers_and_a_foreign_or_damaged_one_is_refused(packs):
    loader = loader_of(mixture(packs))
    batches = iter(loader)
    batches_before = [next(batches)]
    state = json.loads(json.dumps(loader.state_dict()))
    del batches
    halves = Mix({"lmdb": readers.LMDBDataset(packs / "d.lmdb", decode="raw"),
                  "web": readers.WDSDataset(packs / "d.wds", decode="raw", shuffle=4, seed=SEED)},
                 weights={"lmdb": 0.5, "web": 0.5}, seed=SEED, epoch_size=EPOCH)
    with pytest.raises(ValueError, match=r"another mixture: weights .*'lmdb': 0.7.*now.*0.5.*reweight=True"):
        loader_of(halves).load_state_dict(state)
    with pytest.raises(ValueError, match="stream source 'web' is not the stream the state was saved over"):
        loader_of(mixture(packs, shuffle=8)).load_state_dict(state)
    # Resumed on 1 worker, and saved again: the stream's base holds a per-rank segment of its history
    resumed = loader_of(mixture(packs), workers=1)
    resumed.load_state_dict(state)
    batches = iter(resumed)
    second = next(batches)
    again = json.loads(json.dumps(resumed.state_dict()))
    del batches
    segment = again["dataset"]["anchor"]["bases"]["web"]["histories"][0][-1]
    assert set(segment) == {"world_size", "workers", "ranks"} and len(segment["ranks"][0]) == 2
    assert len(json.dumps(again)) < 2000
    last = loader_of(mixture(packs), workers=3)  # and on 3: the epoch's samples each once
    last.load_state_dict(again)
    lmdb, web = split([batches_before[0], second, *last], packs)
    assert sorted(lmdb) == sorted(set(lmdb)) and len(lmdb) == 70 and len(web) == 30 == len(set(web))
    for damage, message in ((lambda s: s["ranks"].append([0, 0]), "or world_size, workers and ranks"),
                            (lambda s: s.update(world_size=10 ** 9), "world_size at most 65536"),
                            (lambda s: s["ranks"][0].__setitem__(0, 10 ** 6), "samples read from the streams")):
        bad = copy.deepcopy(again)
        damage(bad["dataset"]["anchor"]["bases"]["web"]["histories"][0][-1])
        with pytest.raises(ValueError, match=message):
            loader_of(mixture(packs), workers=2).load_state_dict(bad)


def test_a_source_added_or_removed_on_resume_with_reweight(packs):
    """lmdb + web, stopped after 3 batches on 2 workers; resumed on 1 with lmdb removed and hdf5
    and a second stream (the same shards, another seed) added: web goes on where it was, the
    added sources start their passes, and the rest of the epoch follows the new weights."""
    loader = loader_of(mixture(packs))
    batches = iter(loader)
    head = [next(batches) for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    del batches
    new = Mix({"hdf5": readers.HDF5Dataset(packs / "d.h5", decode="raw"),  # index 0, web stays 1: the same ids
               "web": readers.WDSDataset(packs / "d.wds", decode="raw", shuffle=4, seed=SEED),
               "web2": readers.WDSDataset(packs / "d.wds", decode="raw", shuffle=4, seed=SEED + 1)},
              weights={"hdf5": 0.4, "web": 0.3, "web2": 0.3}, seed=SEED, epoch_size=EPOCH, reweight=True)
    resumed = loader_of(new, workers=1)
    resumed.load_state_dict(state)
    rest = [i for batch in resumed for i in batch]
    _, head_web = split(head, packs)
    hdf5, web, web2 = ([i for i in rest if i in ids_of(packs, s)] for s in range(3))
    assert len(hdf5) + len(web) + len(web2) == len(rest) == EPOCH - 3 * BATCH
    assert [abs(len(part) - share * len(rest)) <= 2 for part, share in ((hdf5, 0.4), (web, 0.3), (web2, 0.3))] \
        == [True] * 3
    assert len(set(hdf5)) == len(hdf5) and len(set(web2)) == len(web2), "the added sources start their passes"
    assert not set(web) & set(head_web) and len(set(web)) == len(web), "web goes on where it was"
