"""Exact mid-epoch resume (docs/resume.md): after k batches, a new process that loads the
saved state yields exactly the rest of that epoch, then the epochs a run never interrupted
yields; for every order (ShuffleSampler, BlockShuffleSampler, WDSDataset's stream) and
every format (LMDB, HDF5, WDS by index, WDS streamed), with 2 workers, through
make_loader's loader and torchdata's StatefulDataLoader, and on 2 gloo ranks.

Samples are named by the CRC-32 of their raw bytes (every image differs), so a batch is a
list of names and a repeated or skipped sample shows as a mismatch. The new processes run
this file as a script: `python tests/test_resume.py resume|ddp JOBFILE [RANK]`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers

import readers  # noqa: E402
from readers import BlockShuffleSampler, ShuffleSampler, WDSDataset, make_loader  # noqa: E402

from conftest import packed_three_ways, sample_ids  # noqa: E402

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates; nothing of packer's.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

BATCH, SEED, WORKERS = 5, 3, 2
# name: (format, order); "stream" is WDSDataset's own, over the shards.
CASES = {f"{fmt}-{order}": (fmt, order) for order in ("random", "block") for fmt in ("lmdb", "hdf5", "wdsmap")}
CASES["wds-stream"] = ("wds", "stream")
STATEFUL_CASES = ("lmdb-random", "hdf5-block", "wdsmap-random", "wds-stream")
PACKS = {"lmdb": "d.lmdb", "hdf5": "d.h5", "wdsmap": "d.wds", "wds": "d.wds"}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    """100 tiny JPEGs of 4 classes, packed three ways: LMDB in a shuffled storage order (so
    block order goes through it), HDF5 in ImageFolder order, WDS in 12 shards."""
    return packed_three_ways(tmp_path_factory.mktemp("resume"))


def dataset(spec: dict):
    fmt, _ = CASES[spec["case"]]
    path = Path(spec["root"]) / PACKS[fmt]
    if fmt == "wds":
        return WDSDataset(path, decode="raw", shuffle=16, seed=SEED)
    kind = {"lmdb": readers.LMDBDataset, "hdf5": readers.HDF5Dataset, "wdsmap": readers.WDSMapDataset}[fmt]
    return kind(path, decode="raw")


def build(spec: dict):
    """(loader, what to call set_epoch on before each epoch: None where the loader counts)."""
    _, order = CASES[spec["case"]]
    data = dataset(spec)
    if spec["loader"] == "make_loader":
        return make_loader(data, BATCH, workers=WORKERS, seed=SEED, order=None if order == "stream" else order,
                           block_size=4, window=3, collate_fn=sample_ids), None
    from torchdata.stateful_dataloader import StatefulDataLoader

    if order == "stream":
        return StatefulDataLoader(data, BATCH, num_workers=WORKERS, drop_last=True, collate_fn=sample_ids,
                                  persistent_workers=True), data
    sampler = (ShuffleSampler(data, seed=SEED) if order == "random"
               else BlockShuffleSampler(data, block_size=4, window=3, seed=SEED))
    return StatefulDataLoader(data, BATCH, sampler=sampler, num_workers=WORKERS, drop_last=True,
                              collate_fn=sample_ids, persistent_workers=True), sampler


def epochs(loader, target, first: int, count: int) -> list[list[list[int]]]:
    """count passes from epoch `first`, each a list of batches."""
    passes = []
    for epoch in range(first, first + count):
        if target is not None:
            target.set_epoch(epoch)
        passes.append(list(loader))
    return passes


def interrupted(spec: dict, epoch: int, k: int) -> tuple[list, dict]:
    """(the first k batches of `epoch`, the state saved after them), epochs before it run whole."""
    loader, target = build(spec)
    epochs(loader, target, 0, epoch)
    if target is not None:
        target.set_epoch(epoch)
    batches = iter(loader)
    head = [next(batches) for _ in range(k)]
    state = loader.state_dict()
    del batches
    return head, state


def resumed(spec: dict, state: dict, epoch: int, count: int) -> list:
    """In this process: a new loader given `state`, then `count` passes from `epoch`."""
    loader, target = build(spec)
    loader.load_state_dict(state)
    return epochs(loader, target, epoch, count)


def run_script(*args, timeout: int = 120) -> None:
    done = subprocess.run([sys.executable, __file__, *map(str, args)], capture_output=True, text=True,
                          cwd=HERE.parent, timeout=timeout)
    assert done.returncode == 0, f"the new process failed:\n{done.stderr[-4000:]}"


def through_torch_save(state: dict, tmp_path: Path) -> dict:
    """state after torch.save and a weights_only torch.load: plain data survives both."""
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded == state
    return loaded


def test_a_new_process_resumes_every_order_and_format_exactly(packs, tmp_path):
    jobs, expected = [], {}
    plan = [("make_loader", case, 3) for case in CASES] + [("stateful", case, 3) for case in STATEFUL_CASES]
    plan += [("make_loader", "lmdb-block", 0), ("make_loader", "wds-stream", 18), ("stateful", "wds-stream", 8)]
    uninterrupted = {}  # by case: both loaders yield the same batches (the same sampler or stream)
    for loader_kind, case, k in plan:
        spec = {"case": case, "loader": loader_kind, "root": packs}
        name = f"{loader_kind}/{case}/k={k}"
        if case not in uninterrupted:
            uninterrupted[case] = epochs(*build(spec), 0, 3)
        full = uninterrupted[case]
        samples = [s for batch in full[1] for s in batch]
        assert len(samples) == len(set(samples)) >= 90, name  # one epoch: each sample once
        assert full[1] != full[2], name  # epochs differ, so a wrong epoch shows
        head, state = interrupted(spec, 1, k)
        assert head == full[1][:k], name
        jobs.append({"name": name, "spec": spec, "state": through_torch_save(state, tmp_path)})
        expected[name] = full
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run_script("resume", tmp_path / "jobs.json")
    results = json.loads((tmp_path / "jobs.json.out").read_text())
    for job in jobs:
        name, k, full = job["name"], int(job["name"].rpartition("=")[2]), expected[job["name"]]
        rest, following = results[name]
        assert full[1][:k] + rest == full[1], f"{name}: the resumed epoch is not the rest of the epoch"
        assert following == full[2], f"{name}: the epoch after the resumed one differs"


def resume_jobs(path: str) -> None:
    """Script side of the test above: each job's state loaded into a new loader."""
    jobs = json.loads(Path(path).read_text())
    results = {job["name"]: resumed(job["spec"], job["state"], 1, 2) for job in jobs}
    Path(path + ".out").write_text(json.dumps(results))


DDP_CASES = ("lmdb-random", "wds-stream")


def test_two_gloo_ranks_resume_from_their_own_state_or_rank_zeros(packs, tmp_path):
    for phase in ("save", "resume"):
        procs = [subprocess.Popen([sys.executable, __file__, "ddp", str(tmp_path), str(rank), phase, packs],
                                  cwd=HERE.parent, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"rank {rank} ({phase}) failed:\n{err[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for case in DDP_CASES:
        shares = [set(s for batch in ranks[rank][case]["full"][0] for s in batch) for rank in range(2)]
        assert not shares[0] & shares[1] and len(shares[0] | shares[1]) >= 90, case  # ranks split the data
        for rank in range(2):
            got = ranks[rank][case]
            full, head = got["full"], got["head"]
            assert head == full[0][:len(head)] and 0 < len(head) < len(full[0])
            for source in ("own", "rank0"):
                rest, following = got[source]
                assert head + rest == full[0], f"{case}: rank {rank} resumed from {source} state"
                assert following == full[1], f"{case}: rank {rank}, epoch after, from {source} state"


def ddp(folder: str, rank: int, phase: str, root: str) -> None:
    """Script side of the test above: one rank of 2 in a gloo group; "save" records two
    uninterrupted epochs and the state after 3 batches, "resume" (new processes) resumes
    from this rank's state and from rank 0's."""
    import torch.distributed as dist

    folder = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'group'}-{phase}", rank=rank, world_size=2)
    out = folder / f"rank{rank}.json"
    try:
        record = json.loads(out.read_text()) if phase == "resume" else {}
        for case in DDP_CASES:
            spec = {"case": case, "loader": "make_loader", "root": root}
            if phase == "save":
                head, state = interrupted(spec, 0, 3)
                torch.save(state, folder / f"{case}-{rank}.pt")
                record[case] = {"full": epochs(*build(spec), 0, 2), "head": head}
            else:
                for source, saved in (("own", rank), ("rank0", 0)):
                    state = torch.load(folder / f"{case}-{saved}.pt", weights_only=True)
                    record[case][source] = resumed(spec, state, 0, 2)
        out.write_text(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_state_is_plain_data_and_names_what_differs(packs):
    spec = {"case": "lmdb-random", "loader": "make_loader", "root": packs}
    _, state = interrupted(spec, 0, 2)
    assert json.loads(json.dumps(state)) == state
    assert state["epoch"] == 0 and state["batches"] == 2 and state["sampler"]["position"] == 2 * BATCH
    data = dataset(spec)
    with pytest.raises(ValueError, match="seed 3 \\(now 4\\)"):
        make_loader(data, BATCH, workers=0, seed=SEED + 1).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size 5 \\(now 6\\)"):
        make_loader(data, BATCH + 1, workers=0, seed=SEED).load_state_dict(state)
    mixed = {**state, "sampler": {**state["sampler"], "position": 3 * BATCH}}  # parts of two checkpoints
    with pytest.raises(ValueError, match="sampler state \\(epoch 0, position 15\\) disagrees"):
        make_loader(data, BATCH, workers=0, seed=SEED).load_state_dict(mixed)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):  # any other world size loads
        ShuffleSampler(data, seed=SEED, drop_last=True, rank=1, world_size=2).load_state_dict(
            {**state["sampler"], "world_size": 0})
    other = readers.HDF5Dataset(Path(packs) / "d.h5", decode="raw")  # the same images, stored in another order
    with pytest.raises(ValueError, match="different dataset"):
        BlockShuffleSampler(other).load_state_dict(BlockShuffleSampler(data).state_dict())
    with pytest.raises(ValueError, match="not a ShuffleSampler state"):
        ShuffleSampler(data).load_state_dict(BlockShuffleSampler(data).state_dict())
    with pytest.raises(ValueError, match="position must be an int >= 0 <= 100"):
        ShuffleSampler(data).load_state_dict({**ShuffleSampler(data).state_dict(), "position": 101})


def test_a_stream_state_names_its_shards_workers_and_buffer(packs):
    spec = {"case": "wds-stream", "loader": "make_loader", "root": packs}
    _, state = interrupted(spec, 0, 3)
    other = make_loader(WDSDataset(Path(packs) / "d.wds", decode="raw", shuffle=8, seed=SEED), BATCH,
                        workers=WORKERS, collate_fn=sample_ids)
    with pytest.raises(ValueError, match="shuffle 16 \\(now 8\\)"):
        other.load_state_dict(state)
    make_loader(dataset(spec), BATCH, workers=1, collate_fn=sample_ids).load_state_dict(state)  # test_elastic.py
    alone = dataset(spec)
    samples = iter(alone)
    next(samples)
    own = alone.state_dict()  # one worker's own stream, as StatefulDataLoader saves it
    elsewhere = WDSDataset(Path(packs) / "d.wds", decode="raw", shuffle=16, seed=SEED, rank=0, world_size=2)
    elsewhere.load_state_dict(own)  # a rank's only stream: its count is every rank's (test_elastic.py)
    next(iter(elsewhere))  # its rest, dealt to 2 ranks
    shards = sorted(str(p) for p in (Path(packs) / "d.wds" / "all").glob("*.tar"))
    fewer_shards = make_loader(WDSDataset(shards[:-1], decode="raw", shuffle=16, seed=SEED), BATCH, workers=WORKERS,
                               collate_fn=sample_ids)
    with pytest.raises(ValueError, match="different dataset '12 shards, 100 samples"):
        fewer_shards.load_state_dict(state)


@pytest.mark.parametrize("shuffle", [0, 16])
@pytest.mark.parametrize("read", ["by index", "parsed"])
def test_a_resumed_stream_skips_the_shards_it_has_consumed(packs, monkeypatch, shuffle, read):
    path = Path(packs) / "d.wds"
    if read == "parsed":  # the shards alone: no packer index to read them by
        path = sorted(str(p) for p in (path / "all").glob("*.tar"))
    stream = WDSDataset(path, decode="raw", shuffle=shuffle, seed=SEED)
    stream.set_epoch(1)
    full = [zlib.crc32(image) for image, _ in stream]
    samples = iter(stream)
    head = [zlib.crc32(next(samples)[0]) for _ in range(80)]
    state = stream.state_dict()  # this process's own stream, as a worker saves it
    assert state["epoch"] == 1 and state["position"] == {"rank": 0, "worker": 0, "workers": 1, "samples": 80}
    opened = []
    real = WDSDataset.shard_samples

    def recorded(self, shard, *args, **kwargs):  # the real reader, each shard it reads noted
        opened.append(self.shards[shard])
        return real(self, shard, *args, **kwargs)

    monkeypatch.setattr(WDSDataset, "shard_samples", recorded)
    again = WDSDataset(path, decode="raw", shuffle=shuffle, seed=SEED)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert head + [zlib.crc32(image) for image, _ in again] == full
    # Sample 80 onwards: the shards from the one holding it (in the epoch's shard order);
    # with a buffer, also the shards still holding buffered samples; the rest unread.
    tasks, first, rest = stream.plan(0, 1), 0, []
    for task in tasks:
        first += stream.task_size(task)
        if first > 80:
            rest.append(stream.shards[task.shard])
    assert len(opened) == len(set(opened)) and set(rest) <= set(opened), opened
    if not shuffle:
        assert opened == rest
    else:  # buffered samples reach back a few shards (seeded: 6 of the 12 here)
        assert len(opened) <= len(tasks) // 2
    again.set_epoch(2)
    stream.set_epoch(2)
    assert list(again) == list(stream)  # the epoch after


def test_wrappers_forward_the_state_and_a_random_sampler_refuses_mid_epoch(packs, tmp_path):
    spec = {"case": "hdf5-random", "loader": "make_loader", "root": packs}
    full = epochs(*build(spec), 0, 2)
    wrapped = make_loader(dataset(spec), BATCH, workers=WORKERS, seed=SEED, collate_fn=sample_ids, device="cpu",
                          stats=True)  # LoaderStats over CUDAPrefetcher over the EpochLoader
    batches = iter(wrapped)
    head = [next(batches) for _ in range(4)]
    state = wrapped.state_dict()
    del batches
    again = make_loader(dataset(spec), BATCH, workers=WORKERS, seed=SEED, collate_fn=sample_ids, device="cpu")
    again.load_state_dict(state)
    assert head + list(again) == full[0] and list(again) == full[1]
    plain = Plain([(bytes([i]), 0) for i in range(20)])
    unseeded = make_loader(plain, BATCH, workers=0, collate_fn=sample_ids)  # torch's RandomSampler
    assert isinstance(unseeded.sampler, torch.utils.data.RandomSampler)
    assert unseeded.state_dict()["batches"] == 0  # between epochs: nothing to resume
    batches = iter(unseeded)
    next(batches)
    with pytest.raises(ValueError, match="RandomSampler has no seeded, stateful order"):
        unseeded.state_dict()


@pytest.mark.parametrize("world_size", [1, 3])
def test_an_evaluation_pass_resumes_mid_epoch_in_index_order(packs, monkeypatch, world_size):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(world_size - 1))
    spec = {"case": "hdf5-random", "loader": "make_loader", "root": packs}
    evaluation = make_loader(dataset(spec), BATCH, train=False, workers=WORKERS, collate_fn=sample_ids)
    whole = list(evaluation)
    share = torch.utils.data.DistributedSampler(range(100), world_size, world_size - 1, shuffle=False)
    assert list(evaluation.sampler) == list(share)  # index order: DistributedSampler's share of it
    batches = iter(evaluation)
    head = [next(batches) for _ in range(2)]
    state = evaluation.state_dict()
    del batches
    again = make_loader(dataset(spec), BATCH, train=False, workers=WORKERS, collate_fn=sample_ids)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert head + list(again) == whole


class Plain(torch.utils.data.Dataset):
    """A user's dataset: no packer reader behind it."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]

if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume_jobs(sys.argv[2])
    elif sys.argv[1] == "ddp":
        ddp(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
