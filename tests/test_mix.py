"""Mixtures (readers.mix, docs/mixing.md): every sample of each source counted per epoch and
across epochs, batches close to the weights, resume on other ranks and workers with and
without a change of weights (the draws made stay made, each source's pass goes on), labels
merged by name, and bad input refused before any batch. The multi-process elastic resume of
a mixture is tests/test_elastic.py's "mix" case; Lightning and Accelerate, tests/test_frameworks.py's.
"""
from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import readers
from readers import Mix, MixSampler, make_loader
from readers.mix import split_counts

from benchmarks.mix import Synthetic

from conftest import class_sorted_tree, goes_on, jpeg_bytes, packed_three_ways, sample_ids, write

BATCH, SEED = 5, 3
WEIGHTS = {"lmdb": 0.7, "hdf5": 0.3}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    return Path(packed_three_ways(tmp_path_factory.mktemp("mix")))


def sources(packs: Path) -> dict:
    return {"lmdb": readers.LMDBDataset(packs / "d.lmdb", decode="raw"),
            "hdf5": readers.HDF5Dataset(packs / "d.h5", decode="raw")}


def mixture(packs: Path, weights=None, **kwargs) -> Mix:
    return Mix(sources(packs), weights=weights or WEIGHTS, seed=SEED, epoch_size=100, **kwargs)


def by_source(ids: list[int], mix: Mix, packs: Path) -> dict[str, list[int]]:
    """Sample ids (sample_ids's, of a mixture) split by source, in order."""
    names = {}
    for s, name in enumerate(mix.names):
        for sample in mix.sources[s]:
            names[sample_ids([(sample[0], 0, s)])[0]] = name
    out = {name: [] for name in mix.names}
    for i in ids:
        out[names[i]].append(i)
    return out


def flat(batches) -> list[int]:
    return [s for batch in batches for s in batch]


def interleaved(ranks: list[list[int]]) -> list[int]:
    return [s for step in zip(*ranks) for s in step]


def in_steps(order: list[int], size: int) -> list[list[int]]:
    """An order cut into runs of `size`, each sorted: the ranks of one step share a run of the
    one order, dealt by source, so two world sizes agree on the runs of a common multiple."""
    return [sorted(order[i:i + size]) for i in range(0, len(order), size)]


@pytest.mark.parametrize("order", ["random", "block"])
def test_every_sample_of_each_source_per_epoch_and_across_epochs(packs, order):
    """0.7/0.3 of 100 per epoch: lmdb's pass of 100 spans two epochs, hdf5's four; every sample of a
    source is drawn once before any is drawn again, with real workers."""
    mix = mixture(packs)
    loader = make_loader(mix, 10, workers=2, seed=SEED, order=order, block_size=4, window=3,
                         collate_fn=sample_ids, drop_last=False)
    epochs = [by_source(flat(loader), mix, packs) for _ in range(5)]
    for epoch in epochs:
        assert (len(epoch["lmdb"]), len(epoch["hdf5"])) == (70, 30)
    lmdb = [s for e in epochs for s in e["lmdb"]]
    hdf5 = [s for e in epochs for s in e["hdf5"]]
    assert len(set(lmdb[:100])) == 100 and len(set(lmdb[100:200])) == 100 and lmdb[:100] != lmdb[100:200]
    assert len(set(hdf5[:100])) == 100 and len(set(hdf5[100:150])) == 50  # a new pass after all 100
    assert set(epochs[0]["hdf5"]).isdisjoint(epochs[1]["hdf5"])  # down-weighted: new samples each epoch


def test_each_batch_holds_its_weights_share(packs):
    mix = mixture(packs)
    batches = list(make_loader(mix, 10, workers=0, seed=SEED, collate_fn=lambda b: [s for _, _, s in b]))
    shares = [batch.count(0) for batch in batches]
    assert len(batches) == 10 and all(6 <= n <= 8 for n in shares), shares


def test_batches_of_256_hold_179_plus_or_minus_3_of_the_first_source_on_any_ranks():
    """Weights 0.7/0.3, 60,000 samples an epoch: every full batch of 256 of every rank, on 1, 2,
    3 and 8 ranks, holds 178-181 (the share of its step's run of positions, within 1)."""
    mix = Mix({"a": Synthetic(40_000), "b": Synthetic(20_000)}, weights={"a": 0.7, "b": 0.3})
    for world_size in (1, 2, 3, 8):
        for rank in range(world_size):
            sampler = MixSampler(mix, rank=rank, world_size=world_size, keyed=False)
            first = mix.source_of(list(sampler)) == 0
            counts = first[:len(first) // 256 * 256].reshape(-1, 256).sum(1)
            assert 178 <= counts.min() and counts.max() <= 181, (world_size, rank, counts.min(), counts.max())


def test_ranks_share_each_step_of_the_one_order():
    """On W ranks, step p hands out the one order's positions [pW, (p + 1)W), dealt by source:
    the same samples as on one rank, whatever W, and every rank of three sources near its shares."""
    mix = Mix({"a": Synthetic(3000), "b": Synthetic(2000), "c": Synthetic(1000)}, weights={"a": 0.5, "b": 0.3, "c": 0.2})
    one = list(MixSampler(mix, keyed=False))
    for world_size in (2, 3, 8):
        ranks = [list(MixSampler(mix, rank=r, world_size=world_size, keyed=False)) for r in range(world_size)]
        steps = [sorted(step) for step in zip(*ranks)]
        assert steps[:-1] == [sorted(one[p * world_size:(p + 1) * world_size]) for p in range(len(steps) - 1)]
        for indexes in ranks:
            counts = np.stack([(mix.source_of(indexes[:len(indexes) // 100 * 100]) == s).reshape(-1, 100).sum(1)
                               for s in range(3)])
            assert (np.abs(counts - np.array([[50], [30], [20]])) <= 5).all(), (world_size, counts.min(1), counts.max(1))


def test_the_schedules_prefix_counts_split_every_prefix_by_the_weights():
    weights = (0.5, 0.3, 0.15, 0.05, 0.0)
    last = np.zeros(5, np.int64)
    for x in range(0, 12_000, 97):
        counts = split_counts(x, weights)
        assert counts.sum() == x and (counts >= last).all() and counts[4] == 0
        assert (np.abs(counts - x * np.array(weights)) <= 2).all()
        last = counts


def test_a_plain_dataloader_and_an_epoch_size_of_ones_own(packs):
    mix = Mix(sources(packs), weights={"lmdb": 1, "hdf5": 3}, seed=SEED, epoch_size=40)
    sampler = MixSampler(mix)
    loader = tud.DataLoader(mix, 8, sampler=sampler, num_workers=2, collate_fn=sample_ids)
    epoch = by_source(flat(loader), mix, packs)
    assert (len(epoch["lmdb"]), len(epoch["hdf5"])) == (10, 30)
    sampler.set_epoch(1)
    again = by_source(flat(loader), mix, packs)
    assert set(again["hdf5"]).isdisjoint(epoch["hdf5"]) and set(again["lmdb"]).isdisjoint(epoch["lmdb"])
    default = Mix(sources(packs))  # weights by size, an epoch of every sample once
    assert len(set(MixSampler(default))) == 200 and default.weights == (0.5, 0.5)


def pass_of(packs: Path, name: str, draws: int) -> list[int]:
    """The first `draws` of a source's passes, in order: a mixture of it alone draws them."""
    only = Mix(sources(packs), weights={n: float(n == name) for n in ("lmdb", "hdf5")}, seed=SEED,
               epoch_size=draws)
    return flat(make_loader(only, BATCH, workers=0, seed=SEED, collate_fn=sample_ids, drop_last=False))


def run_ranks(packs: Path, world_size: int, workers: int, take: int, state=None, weights=None, **mix_kwargs):
    """In-process ranks of a make_loader over the mixture: (batches each handed out, rank 0's state)."""
    handed, states = [], []
    for rank in range(world_size):
        loader = make_loader(mixture(packs, weights, **mix_kwargs), BATCH, workers=workers, seed=SEED,
                             collate_fn=sample_ids, drop_last=False)
        loader.sampler.rank, loader.sampler.world_size = rank, world_size
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        batches = iter(loader)
        handed.append([next(batches) for _ in range(take)] if take is not None else list(batches))
        states.append(loader.state_dict())
        del batches
    assert all(s == states[0] for s in states), "every rank saves the same state"
    return handed, states[0]


@pytest.mark.parametrize("take", [0, 1, 5, 9, 10])  # batches of 5 per rank of 2: 10 make the epoch
def test_new_weights_on_resume_keep_the_draws_made_and_each_sources_pass(packs, take):
    """2 ranks x 1 worker stop after `take` batches; 3 ranks x 2 workers go on at 0.2/0.8 (at the
    first batch, mid-way, in the last batch, at the end): nothing consumed comes again, the rest of
    the epoch follows the new weights, and each source's draws go on along its own pass."""
    head, state = run_ranks(packs, 2, 1, take)
    heads = by_source(interleaved([flat(h) for h in head]), mixture(packs), packs)
    new = {"lmdb": 0.2, "hdf5": 0.8}
    rest, _ = run_ranks(packs, 3, 2, None, state, new, reweight=True)
    mix = mixture(packs, new, reweight=True)
    consumed = sum(len(v) for v in heads.values())
    left = 100 - consumed or 100  # a state saved at the end resumes at the next epoch
    ordered = interleaved([flat(r) for r in rest])
    assert len({len(r) for r in rest}) == 1 and len(ordered) - left < 3  # padding: < 3 repeats
    ordered = ordered[:left]
    rests = by_source(ordered, mix, packs)
    assert abs(len(rests["hdf5"]) - 0.8 * left) <= 2, (len(rests["hdf5"]), left)
    for name in ("lmdb", "hdf5"):
        parts = [heads[name], rests[name]]
        assert goes_on(parts, pass_of(packs, name, len(heads[name] + rests[name]))), f"{name}'s pass stopped"
    # The next epoch: all at the new weights, the passes still going on
    loader = make_loader(mix, BATCH, workers=0, seed=SEED, collate_fn=sample_ids, drop_last=False)
    loader.load_state_dict(state)
    epochs = [by_source(flat(loader), mix, packs) for _ in range(2)]
    assert (len(epochs[1]["lmdb"]), len(epochs[1]["hdf5"])) == (20, 80)
    for name in ("lmdb", "hdf5"):
        parts = [heads[name], epochs[0][name], epochs[1][name]]
        assert goes_on(parts, pass_of(packs, name, sum(map(len, parts))))


def test_a_source_added_or_removed_on_resume(packs):
    head, state = run_ranks(packs, 1, 0, 4)
    heads = by_source(flat(head[0]), mixture(packs), packs)
    extra = readers.LMDBDataset(packs / "d.lmdb", decode="raw")
    # hdf5 stays source 1, so sample_ids names its samples as before
    mix = Mix({"more": extra, "hdf5": readers.HDF5Dataset(packs / "d.h5", decode="raw")},
              weights={"more": 0.5, "hdf5": 0.5}, seed=SEED, epoch_size=100, reweight=True)
    loader = make_loader(mix, BATCH, workers=0, seed=SEED, collate_fn=sample_ids, drop_last=False)
    loader.load_state_dict(state)
    rest = flat(loader)
    assert len(rest) == 100 - 20
    kinds = collections.Counter(mix.source_of(list(MixSampler(mix))))
    assert kinds == {0: 50, 1: 50}  # a fresh epoch of the new mixture
    hdf5 = [i for i in rest if i in set(pass_of(packs, "hdf5", 100))]
    assert heads["hdf5"] + hdf5 == pass_of(packs, "hdf5", len(heads["hdf5"]) + len(hdf5))


def test_a_state_of_another_mixture_is_refused_without_reweight(packs):
    _, state = run_ranks(packs, 1, 0, 2)
    loader = make_loader(mixture(packs, {"lmdb": 0.5, "hdf5": 0.5}), BATCH, workers=0, seed=SEED,
                         collate_fn=sample_ids, drop_last=False)
    with pytest.raises(ValueError, match=r"another mixture: weights .*'lmdb': 0.7.*now.*0.5.*reweight=True"):
        loader.load_state_dict(state)
    other_seed = make_loader(Mix(sources(packs), weights=WEIGHTS, seed=SEED + 1, epoch_size=100), BATCH,
                             workers=0, collate_fn=sample_ids, drop_last=False)
    with pytest.raises(ValueError, match="different seed"):
        other_seed.load_state_dict(state)


def test_a_source_replaced_on_disk_since_the_state_was_saved_is_refused(packs, tmp_path):
    from packer import pack

    src = class_sorted_tree(tmp_path / "src", classes=4, per_class=25)
    pack(str(src), "hdf5", str(tmp_path / "d.h5"), workers=1, progress=False)
    own = {"lmdb": readers.LMDBDataset(packs / "d.lmdb", decode="raw"),
           "hdf5": readers.HDF5Dataset(tmp_path / "d.h5", decode="raw")}
    loader = make_loader(Mix(own, weights=WEIGHTS, seed=SEED), BATCH, workers=0, collate_fn=sample_ids)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    for path in sorted(src.rglob("*.jpg"))[:3]:  # the same names and classes, other images
        path.write_bytes(jpeg_bytes(5000 + len(path.name), size=(96, 80)))
    pack(str(src), "hdf5", str(tmp_path / "d.h5"), workers=1, progress=False, force=True)
    again = {**own, "hdf5": readers.HDF5Dataset(tmp_path / "d.h5", decode="raw")}
    for reweight in (False, True):
        fresh = make_loader(Mix(again, weights=WEIGHTS, seed=SEED, reweight=reweight), BATCH, workers=0,
                            collate_fn=sample_ids)
        with pytest.raises(ValueError, match="source 'hdf5' has changed since the state was saved"):
            fresh.load_state_dict(state)


@pytest.mark.parametrize("weights, message", [
    ({"lmdb": -1, "hdf5": 1}, "weight of source 'lmdb' must be a finite number >= 0, got -1"),
    ({"lmdb": math.nan, "hdf5": 1}, "weight of source 'lmdb' must be a finite number >= 0, got nan"),
    ({"lmdb": 0, "hdf5": 0.0}, "every weight is 0"),
    ({"lmdb": 1, "hdf5": 1, "web": 1}, "weights name unknown source.*'web'; the sources are 'lmdb', 'hdf5'"),
    ({"lmdb": 1}, "no weight for source.*'hdf5'.*0 leaves one out"),
])
def test_bad_weights_are_refused_naming_the_source(packs, weights, message):
    with pytest.raises(ValueError, match=message):
        Mix(sources(packs), weights=weights)


def test_bad_sources_are_refused_before_any_batch(packs):
    with pytest.raises(ValueError, match="source 'none' is empty"):
        Mix({**sources(packs), "none": Synthetic(0)})
    with pytest.raises(ValueError, match=r"samples differ in kind \('lmdb' gives raw bytes, 'pil' gives PIL image"):
        Mix({"lmdb": sources(packs)["lmdb"], "pil": readers.HDF5Dataset(packs / "d.h5")})
    with pytest.raises(ValueError, match="epoch_size must be a positive int"):
        Mix(sources(packs), epoch_size=0)


def test_a_webdataset_folder_mixes_by_index(packs):
    mix = Mix({"lmdb": sources(packs)["lmdb"], "wds": readers.WDSMapDataset(packs / "d.wds", decode="raw")})
    seen = by_source(flat(make_loader(mix, 10, workers=0, collate_fn=sample_ids)), mix, packs)
    assert len(set(seen["wds"])) == len(seen["wds"]) == 100 and len(set(seen["lmdb"])) == 100


def test_labels_merge_by_name_or_by_a_mapping_and_unlabeled_sources_are_named(packs, tmp_path):
    from packer import pack

    for c in ("class3", "zebra"):  # one class shared with the packs, one new
        for i in range(3):
            write(tmp_path / "other" / c / f"{i}.jpg", jpeg_bytes(900 + i, size=(96, 80)))
    for i in range(4):
        write(tmp_path / "flat" / f"{i}.jpg", jpeg_bytes(950 + i, size=(96, 80)))
    pack(str(tmp_path / "other"), "lmdb", str(tmp_path / "o.lmdb"), workers=1, progress=False)
    pack(str(tmp_path / "flat"), "lmdb", str(tmp_path / "u.lmdb"), workers=1, progress=False)
    packed, other = sources(packs)["lmdb"], readers.LMDBDataset(tmp_path / "o.lmdb", decode="raw")
    unlabeled = readers.LMDBDataset(tmp_path / "u.lmdb", decode="raw")
    mix = Mix({"packed": packed, "other": other})
    assert mix.classes == ["class0", "class1", "class2", "class3", "zebra"]
    labels = {(s, mix.classes[label]) for _, label, s in (mix[i] for i in range(len(mix)))}
    named = {(0, packed.classes[label]) for _, label in packed} | {(1, other.classes[label]) for _, label in other}
    assert labels == named  # each sample keeps its class's name
    mapping = {"class0": 0, "class1": 0, "class2": 1, "class3": 1, "zebra": 2}
    mapped = Mix({"packed": packed, "other": other}, class_to_idx=mapping)
    assert mapped.classes == ["class0", "class2", "zebra"] and mapped[len(packed)][1] == mapping[
        other.classes[other[0][1]]]
    with pytest.raises(ValueError, match="class_to_idx has no label for class.*'zebra'.*of source 'other'"):
        Mix({"packed": packed, "other": other}, class_to_idx={c: i for i, c in enumerate(packed.classes)})
    with pytest.raises(ValueError, match=r"source\(s\) 'web' have no labels and 'packed' do: pass unlabeled=\('web',\)"):
        Mix({"packed": packed, "web": unlabeled})
    mixed = Mix({"packed": packed, "web": unlabeled}, unlabeled=("web",))
    assert {mixed[i][1] for i in range(len(packed), len(mixed))} == {-1} and mixed.classes == packed.classes
    batch = next(iter(make_loader(Mix({"packed": readers.LMDBDataset(packs / "d.lmdb", decode="tensor",
                                                                      transform=readers.ResizeCenterCrop(32)),
                                       "other": readers.LMDBDataset(tmp_path / "o.lmdb", decode="tensor",
                                                                    transform=readers.ResizeCenterCrop(32))}),
                                  4, workers=0)))
    images, labels, which = batch  # readers.collate gives each sample's source
    assert images.shape == (4, 3, 32, 32) and labels.dtype == which.dtype == torch.int64


@pytest.mark.parametrize("order", ["random", "block"])
def test_torchdata_resumes_a_mixture_on_another_world_size_and_with_new_weights(packs, order):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(rank, world_size, weights=WEIGHTS):
        mix = mixture(packs, weights, reweight=weights != WEIGHTS)
        sampler = MixSampler(mix, order, block_size=4, window=3, rank=rank, world_size=world_size)
        return StatefulDataLoader(mix, BATCH, sampler=sampler, num_workers=2, collate_fn=sample_ids)

    handed, states = [], []
    for rank in range(3):
        saving = loader(rank, 3)
        batches = iter(saving)
        handed.append(flat(next(batches) for _ in range(4)))
        states.append(saving.state_dict())
        del batches
    for weights in (WEIGHTS, {"lmdb": 0.5, "hdf5": 0.5}):
        rest = []
        for rank in range(2):
            resuming = loader(rank, 2, weights)
            resuming.load_state_dict(states[0])
            rest.append(flat(resuming))
        assert len(rest[0]) == len(rest[1])
        together = interleaved(handed) + interleaved(rest)[:100 - 60]
        assert len(together) == len(set(together)) == 100
        if weights == WEIGHTS:  # the one global order, wherever it was stopped
            assert in_steps(together, 6) == in_steps(flat(loader(0, 1)), 6)


def test_a_state_is_small_and_the_same_size_at_20k_and_1_28m_samples():
    sizes = []
    for n in (20_000, 1_281_167):
        mix = Mix({"imagenet": Synthetic(n), "web": Synthetic(n // 3)}, weights={"imagenet": 0.7, "web": 0.3})
        sampler = MixSampler(mix, rank=3, world_size=8)
        batches = iter(sampler)
        for _ in range(1000):
            next(batches)
        state = sampler.state_dict()
        assert state["position"] == 1000
        sizes.append(len(json.dumps(state).replace(str(n), "").replace(str(n // 3), "")))
        elsewhere = MixSampler(mix, rank=0, world_size=5)
        elsewhere.load_state_dict(json.loads(json.dumps(state)))
        assert len(elsewhere) == -(-(mix.epoch_size - 8000) // 5)
    assert abs(sizes[0] - sizes[1]) < 16 and max(sizes) < 700  # a few digits more, nothing per sample


def test_a_damaged_segment_is_refused_naming_the_field(packs):
    _, state = run_ranks(packs, 1, 0, 2)
    for change, message in ((lambda s: s["sampler"]["segment"]["draws"].update(lmdb=-1), "lmdb must be an int >= 0"),
                            (lambda s: s["sampler"]["segment"].update(epoch=7), "segment's epoch 7 .* state of epoch 0"),
                            (lambda s: s["sampler"]["segment"]["draws"].pop("hdf5"), "draws must name"),
                            (lambda s: s["sampler"]["segment"]["draws"].update(lmdb=2 ** 62), "draws .* do not fit"),
                            (lambda s: s["sampler"].pop("schedule"), "another schedule of the mixture .* afresh")):
        damaged = json.loads(json.dumps(state))
        change(damaged)
        damaged["epoch"] = damaged["sampler"]["epoch"]
        loader = make_loader(mixture(packs), BATCH, workers=0, seed=SEED, collate_fn=sample_ids, drop_last=False)
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(damaged)


def test_the_benchmark_walks_an_epoch_in_flat_memory_and_measures_the_spread():
    from benchmarks.mix import memory, spread

    row = memory(4000)  # sources of 4,000 and 1,333: rank 0 of 8 walks its eighth
    assert row["walked"] == math.ceil(5333 / 8) and row["state_bytes"] < 700
    for r in spread(30_000, 0.7, [1, 2]):
        assert r["batches"] == 40_000 // 256 and 176 <= r["min"] <= r["max"] <= 182 and abs(r["mean"] - 179.2) < 0.5


def test_walking_an_epoch_holds_no_more_than_a_chunk():
    """Python's own allocations while rank 0 of 2 walks 100,000 indexes stay under 1 MB: each
    chunk's arrays are freed as the next is made (nothing waits for the garbage collector)."""
    import tracemalloc

    mix = Mix({"a": Synthetic(150_000), "b": Synthetic(50_000)}, weights={"a": 0.7, "b": 0.3})
    sum(1 for _ in MixSampler(mix, rank=0, world_size=2, keyed=False))  # the first walk's one-time costs
    tracemalloc.start()
    try:
        walked = sum(1 for _ in MixSampler(mix, rank=0, world_size=2, keyed=False))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert walked == 100_000 and peak < 2 ** 20, peak


def test_gpu_decode_over_a_mixture_is_refused_saying_what_to_do(packs):
    with pytest.raises(ValueError, match="gpu_decode .* mixture.*decode in the workers"):
        make_loader(mixture(packs), BATCH, workers=0, gpu_decode=True, device="cuda")


class Seeds(tud.Dataset):
    """A source whose samples are the keyed seed their transform would draw from."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        return readers.keyed.call_keyed(readers.keyed.key_of(index), readers.sample_seed), 0


def keyed_draws(world_size: int) -> dict[int, int]:
    """{mixture index: the seed its sample was augmented with} over one epoch, every rank's."""
    mix = Mix({"small": Seeds(5), "large": Seeds(50)}, weights={"small": 0.5, "large": 0.5}, seed=1, epoch_size=40)
    out = collections.defaultdict(list)
    for rank in range(world_size):
        sampler = MixSampler(mix, rank=rank, world_size=world_size)
        for index in sampler:
            out[int(index)].append(mix[index][0])
    return out


def test_a_mixtures_augmentation_is_keyed_by_source_and_pass_on_any_ranks():
    one, three = keyed_draws(1), keyed_draws(3)
    # Every sample's draws are the same whatever the ranks (3 ranks pad at most 2 repeats).
    assert {i: sorted(set(s)) for i, s in one.items()} == {i: sorted(set(s)) for i, s in three.items()}
    small = [seeds for i, seeds in one.items() if i < 5]
    # The small source, drawn 20 times from 5 samples, is in 4 passes: each draw of a sample is augmented afresh.
    assert all(len(seeds) == 4 and len(set(seeds)) == 4 for seeds in small)
    assert None not in {s for seeds in one.values() for s in seeds}


class LabeledSeeds(Seeds):
    """Seeds with classes: sample i is of class i mod len(classes)."""

    def __init__(self, n: int, classes: list[str]):
        super().__init__(n)
        self.classes = classes

    def __getitem__(self, index):
        return super().__getitem__(index)[0], index % len(self.classes)


@pytest.mark.parametrize("keyed", [True, False])
def test_a_batch_is_read_as_its_samples_one_by_one(keyed):
    """Mix.__getitems__ (a batch's parts at once) gives what mix[i] gives each index: the same
    keyed draw, merged label and source, in the batch's order; batches span a small source's
    passes (its keys differ within a part) and both sources, one labeled and one not."""
    mix = Mix({"small": LabeledSeeds(5, ["b", "c"]), "large": LabeledSeeds(50, ["a", "b"]), "web": Seeds(9)},
              weights={"small": 0.4, "large": 0.4, "web": 0.2}, seed=2, epoch_size=60, unlabeled=("web",))
    assert mix.classes == ["b", "c", "a"]
    sampler = MixSampler(mix, rank=1, world_size=2, keyed=keyed)
    sampler.set_epoch(1)
    order = list(sampler)
    batches = [order[k:k + size] for size in (4, 7, 16) for k in range(0, len(order), size)]
    spans = [{i.prefix for i in batch if i < 5} for batch in batches] if keyed else []
    assert not keyed or any(len(span) > 1 for span in spans)  # a part whose indexes are in two passes
    for batch in batches:
        assert mix.__getitems__(batch) == [mix[i] for i in batch]
    assert {label for _, label, s in mix.__getitems__(order) if s == 2} == {-1}
    with pytest.raises(IndexError, match="out of range for 64 samples"):
        mix.__getitems__([3, 64])
