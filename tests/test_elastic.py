"""Elastic resume (docs/resume.md, readers.elastic, readers.wds_elastic): a state saved on
W1 ranks with K1 DataLoader workers, loaded on W2 ranks with K2, yields the samples no rank
had handed out, each once (at most W2 - 1 padded repeats), the same number of batches on
every rank, then the epochs a run started on W2 yields; the samplers' global order is the
same on every world size.

Ranks are separate processes told RANK and WORLD_SIZE (two runs join a gloo group), each
with real DataLoader workers (outside a gloo group, rank 0 is the test's own process); rank 0 saves
the one state every rank loads. Samples are named by the CRC-32 of their raw bytes, so every
sample of the epoch is counted. The processes run this file as a script, each doing the
steps its job file lists: `python tests/test_elastic.py JOBFILE`.
"""
from __future__ import annotations

import collections
import json
import math
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers

import readers  # noqa: E402
from packer import pack  # noqa: E402
from readers import BlockShuffleSampler, ShuffleSampler, WDSDataset, make_loader  # noqa: E402

from conftest import class_sorted_tree, goes_on, packed_three_ways, sample_ids  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

BATCH, SEED = 5, 3
NEW_WEIGHTS = {"lmdb": 0.2, "hdf5": 0.8}  # a mixture's weights on a resume that changes them
# The orders of make_loader's table (readers.loader.SAMPLERS): over LMDB (shuffled storage), HDF5,
# WDS shards, and a mixture of the LMDB and HDF5 packs, 0.7/0.3 (readers.mix)
CASES = ("random", "block", "stream", "mix")
SAMPLER_CASES = ("random", "block", "mix")


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    return packed_three_ways(tmp_path_factory.mktemp("elastic"))


def build(root: str, case: str, workers: int, rank: int | None = None, world_size: int | None = None,
          **weights):
    root = Path(root)
    if case == "stream":
        data = WDSDataset(root / "d.wds", decode="raw", shuffle=16, seed=SEED, rank=rank, world_size=world_size)
        return make_loader(data, BATCH, workers=workers, collate_fn=sample_ids, drop_last=False)
    data = (readers.LMDBDataset(root / "d.lmdb", decode="raw") if case == "random"
            else readers.HDF5Dataset(root / "d.h5", decode="raw") if case == "block" else mixture(root, **weights))
    loader = make_loader(data, BATCH, workers=workers, seed=SEED, order="random" if case == "mix" else case,
                         block_size=4, window=3, collate_fn=sample_ids, drop_last=False)
    if rank is not None:  # in-process ranks: the sampler told its place
        sampler = loader.sampler
        sampler.rank, sampler.world_size = rank, world_size
    return loader


def mixture(root: Path, **weights) -> readers.Mix:
    """The LMDB and HDF5 packs (the same 100 images: sample_ids tells them apart by source) mixed
    0.7/0.3, or by the weights given, in epochs of 100."""
    sources = {"lmdb": readers.LMDBDataset(root / "d.lmdb", decode="raw"),
               "hdf5": readers.HDF5Dataset(root / "d.h5", decode="raw")}
    return readers.Mix(sources, weights=weights or {"lmdb": 0.7, "hdf5": 0.3}, seed=SEED, epoch_size=100,
                       reweight=bool(weights))


def stops(batches: int) -> tuple[int, ...]:
    """Where a pass is stopped, in batches handed out: 0 and batches - 1 inside the first and
    the last batch (the workers have read it ahead), and at the end."""
    return 0, 1, batches // 2, batches - 1, batches


def flat(batches) -> list[int]:
    return [s for batch in batches for s in batch]


def interleaved(ranks: list[list[int]]) -> list[int]:
    """Samples in the order all ranks consume them: rank r's i-th is the global (r + W i)-th."""
    return [s for step in zip(*ranks) for s in step]


def in_steps(order: list[int], case: str, *world_sizes: int) -> list:
    """An order as two world sizes can agree on it: a mixture deals each step's run of the one
    order to its ranks by source (readers.mix.Schedule.dealt), so its runs of a common multiple
    of the world sizes are compared as sets; the other samplers' orders, as they are."""
    if case.removeprefix("sdl-") != "mix":
        return order
    size = math.lcm(*world_sizes)
    return [sorted(order[i:i + size]) for i in range(0, len(order), size)]


def save_side(job: dict) -> dict:
    """Per case: a whole epoch 0, and for each stop the batches handed out before the state."""
    return save_heads(job, CASES, lambda case: build(job["root"], case, job["workers"]))


def save_heads(job: dict, cases, make) -> dict:
    """Per case: a whole epoch 0 of make(case), a loader at epoch 0, and for each stop the
    batches a fresh one handed out before its state (rank 0 saves it)."""
    record = {}
    for case in cases:
        full = list(make(case))
        heads = {}
        for k in stops(len(full)):
            loader = make(case)
            batches = iter(loader)  # the workers start reading ahead
            heads[k] = [next(batches) for _ in range(k)]
            state = loader.state_dict()
            del batches
            if job["rank"] == 0:
                torch.save(state, Path(job["folder"]) / f"{case}-{k}.pt")
        record[case] = {"full": full, "heads": heads}
    return record


def resume_side(job: dict) -> dict:
    """Per case and stop: the rest of epoch 0 from rank 0's state and the epoch after it,
    and a fresh run's epochs 0 and 1 on this world."""
    record = {}
    for case in CASES:
        fresh = build(job["root"], case, job["workers"])
        record[case] = {"fresh": [list(fresh), list(fresh)]}
        for path in Path(job["states"]).glob(f"{case}-*.pt"):
            k = int(path.stem.rpartition("-")[2])
            loader = build(job["root"], case, job["workers"])
            loader.load_state_dict(torch.load(path, weights_only=True))
            record[case][k] = [list(loader), list(loader)]
    return record


def reweight_side(job: dict) -> dict:
    """The mixture's states again, over NEW_WEIGHTS (reweight=True), without workers."""
    record = {}
    for path in Path(job["states"]).glob("mix-*.pt"):
        loader = build(job["root"], "mix", 0, **NEW_WEIGHTS)
        loader.load_state_dict(torch.load(path, weights_only=True))
        record[int(path.stem.rpartition("-")[2])] = [list(loader), list(loader)]
    return {"mix-reweight": record}


SDL_CASES = ("sdl-stream-0", "sdl-stream-1", "sdl-stream-2")  # a stream through StatefulDataLoader, 0 to 2 workers


def stateful(root: str, case: str, rank: int | None = None, world_size: int | None = None):
    """(a torchdata StatefulDataLoader over the stream, the stream, on which set_epoch is called).
    case: sdl-stream-WORKERS, or sdl-stream-WORKERS-spawn for workers started by spawn."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = WDSDataset(Path(root) / "d.wds", decode="raw", shuffle=16, seed=SEED, rank=rank, world_size=world_size)
    workers = int(case.split("-")[2])
    context = "spawn" if case.endswith("-spawn") else None
    return StatefulDataLoader(data, BATCH, num_workers=workers, collate_fn=sample_ids, drop_last=False,
                              multiprocessing_context=context), data


def epoch_of(loader, data, epoch: int) -> list:
    data.set_epoch(epoch)
    return list(loader)


def sdl_save_side(job: dict) -> dict:
    """save_side through StatefulDataLoader: the user sets the epoch; rank 0 saves its state."""
    def at_epoch_zero(case: str):
        loader, data = stateful(job["root"], case)
        data.set_epoch(0)
        return loader

    return save_heads(job, SDL_CASES, at_epoch_zero)


def sdl_resume_side(job: dict) -> dict:
    """resume_side through StatefulDataLoader: the loop resumes at the saved epoch (0)."""
    record = {}
    for case in SDL_CASES:
        loader, data = stateful(job["root"], case)
        record[case] = {"fresh": [epoch_of(loader, data, 0), epoch_of(loader, data, 1)]}
        for path in Path(job["states"]).glob(f"{case}-*.pt"):
            loader, data = stateful(job["root"], case)
            loader.load_state_dict(torch.load(path, weights_only=True))
            record[case][int(path.stem.rpartition("-")[2])] = [epoch_of(loader, data, 0), epoch_of(loader, data, 1)]
    return record


PHASES = {"save": save_side, "resume": resume_side, "reweight": reweight_side, "sdl-save": sdl_save_side,
          "sdl-resume": sdl_resume_side}


def run_phases(phases: dict, names: str, job: dict) -> dict:
    """Script side: the phases named PHASE+PHASE..., one after the other in this process; their
    records merged by case (a save's keys and a resume's differ, and so do the two loaders' cases)."""
    result: dict = {}
    for name in names.split("+"):
        for case, record in phases[name](job).items():
            result.setdefault(case, {}).update(record)
    return result


@dataclass(frozen=True)
class Step:
    """One job of a rank launch: `phase` (PHASE+PHASE...: run_phases) with `workers` DataLoader
    workers a rank, saving into folder and resuming the states in `states` (default: folder)."""
    phase: str
    folder: Path
    workers: int
    states: Path | None = None

    def job(self, root: str, rank: int) -> dict:
        return {"root": root, "folder": str(self.folder), "states": str(self.states or self.folder),
                "workers": self.workers, "rank": rank}


def launch(root: str, world_size: int, steps: list[Step], gloo: bool = False, script=None) -> list:
    """Run world_size ranks, each doing the steps one after the other with the PHASES of `script`
    (a test module; default this one): processes running it as a script (rank_main) told RANK and
    WORLD_SIZE, joined in one gloo group if told, through a file in the first step's folder;
    without one, rank 0 is this process (one start of torch fewer; its loaders' workers forked
    from it). Per step, each rank's record, through json."""
    script = script or sys.modules[__name__]
    procs = {rank: start_rank(root, rank, world_size, steps, gloo, script.__file__)
             for rank in range(0 if gloo else 1, world_size)}
    try:
        here = [] if gloo else run_here(script.PHASES, root, steps, world_size)
    finally:
        errors = {rank: proc.communicate(timeout=240)[1] for rank, proc in procs.items()}
    for rank, proc in procs.items():
        assert proc.returncode == 0, f"{steps[0].phase} rank {rank} of {world_size} failed:\n{errors[rank][-4000:]}"
    return [([here[n]] if here else []) + [json.loads(Path(out(step, n, world_size, r)).read_text()) for r in procs]
            for n, step in enumerate(steps)]


def out(step: Step, n: int, world_size: int, rank: int) -> str:
    return str(step.folder / f"{step.phase}-{n}-{world_size}-{rank}.json")


def start_rank(root: str, rank: int, world_size: int, steps: list[Step], gloo: bool, script: str):
    jobs = [{**step.job(root, rank), "phase": step.phase, "out": out(step, n, world_size, rank)}
            for n, step in enumerate(steps)]
    path = steps[0].folder / f"job-{steps[0].phase}-{world_size}-{rank}.json"
    path.write_text(json.dumps({"rank": rank, "gloo": gloo, "steps": jobs,
                                "group": str(steps[0].folder / f"group-{steps[0].phase}-{world_size}")}))
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size)}
    return subprocess.Popen([sys.executable, script, str(path)], cwd=HERE.parent, env=env, stderr=subprocess.PIPE,
                            text=True)


def run_ranks(phase: str, folder: Path, root: str, world_size: int, workers: int, gloo: bool = False,
              script=None, states: Path | None = None) -> list:
    """launch of one step: each rank's record."""
    return launch(root, world_size, [Step(phase, folder, workers, states)], gloo, script)[0]


def run_here(phases: dict, root: str, steps: list[Step], world_size: int) -> list:
    """Rank 0's steps, run in this process told RANK and WORLD_SIZE: per step, its record."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", "0")
        env.setenv("WORLD_SIZE", str(world_size))
        return [json.loads(json.dumps(run_phases(phases, step.phase, step.job(root, 0)))) for step in steps]


def rank_main(phases: dict) -> None:
    """A launched rank (python SCRIPT JOBFILE): its steps' phases, each record written where told."""
    job = json.loads(Path(sys.argv[1]).read_text())
    if job["gloo"]:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{job['group']}", rank=job["rank"],
                                world_size=int(os.environ["WORLD_SIZE"]))
    for step in job["steps"]:
        Path(step["out"]).write_text(json.dumps(run_phases(phases, step["phase"], step)))
    if job["gloo"]:
        dist.barrier()
        dist.destroy_process_group()


def check_resumes(saved: list, resumed: list, name: str, cases=CASES) -> None:
    """Every stop: the rest is the samples no rank had handed out, each once but for at most
    W2 - 1 repeats, in equal batch counts; the next epoch is a fresh W2 run's."""
    w1, w2 = len(saved), len(resumed)
    for case in cases:
        everything = {s for r in saved for s in flat(r[case]["full"])}
        assert len(everything) == 100
        global_order = interleaved([flat(r[case]["full"]) for r in saved])[:100]
        for k in stops(len(saved[0][case]["full"])):
            where = f"{name} {case} after {k} batches"
            handed = {s for r in saved for s in flat(r[case]["heads"][str(k)])}
            left = everything - handed
            rests = [r[case][str(k)][0] for r in resumed]
            assert len({len(b) for b in rests}) == 1, f"{where}: ranks make different batch counts"
            if k == len(saved[0][case]["full"]):  # every batch handed out: the epoch is over, and a
                # resume starts the next one, as a run started on W2 reads it (docs/frameworks.md); the
                # user's own epoch loop (StatefulDataLoader) finds the saved epoch's rest empty first
                assert not left, where
                if case.startswith("sdl-"):  # StatefulDataLoader's
                    assert rests == [[]] * w2, where
                else:
                    assert rests == [r[case]["fresh"][1] for r in resumed], where
                    continue
            got = collections.Counter(s for batches in rests for s in flat(batches))
            assert left <= set(got), f"{where}: {len(left - set(got))} samples never handed out are skipped"
            if k == 0:  # nothing handed out: the epoch as a run started on W2 reads it (its own padding)
                assert rests == [r[case]["fresh"][0] for r in resumed], where
            else:
                assert sum(got.values()) - len(left) < w2, f"{where}: {sum(got.values()) - len(left)} repeats"
            if case.removeprefix("sdl-") in SAMPLER_CASES:  # the rest of the one global order, from where it stopped
                assert (in_steps(interleaved([flat(b) for b in rests])[:len(left)], case, w1, w2)
                        == in_steps([s for s in global_order if s in left], case, w1, w2)), where
            for rank in range(w2):
                assert resumed[rank][case][str(k)][1] == resumed[rank][case]["fresh"][1], f"{where}: next epoch"


def check_reweighted(saved: list, resumed: list, packs: Path) -> None:
    """Every stop, resumed over NEW_WEIGHTS: the samples handed out stay consumed, the rest of
    the epoch and the next follow the new weights, and each source's pass goes on where it was."""
    mix = mixture(packs, **NEW_WEIGHTS)
    source = {sample_ids([(sample[0], 0, s)])[0]: name for s, name in enumerate(mix.names)
              for sample in mix.sources[s]}
    passes = {}
    for name in mix.names:  # a source's draws in order: a mixture of it alone draws them
        alone = readers.Mix(dict(zip(mix.names, mix.sources)), seed=SEED, epoch_size=300,
                            weights={n: float(n == name) for n in mix.names})
        passes[name] = flat(make_loader(alone, BATCH, workers=0, collate_fn=sample_ids, drop_last=False))
    for k in stops(len(saved[0]["mix"]["full"])):
        where = f"new weights after {k} batches"
        handed = sorted({s for r in saved for s in flat(r["mix"]["heads"][str(k)])})  # less the padding
        left = 100 - len(handed) or 100  # a state saved at the end resumes at the next epoch
        rest = interleaved([flat(r["mix-reweight"][str(k)][0]) for r in resumed])[:left]
        after = [s for r in resumed for s in flat(r["mix-reweight"][str(k)][1])]
        assert len({len(r["mix-reweight"][str(k)][0]) for r in resumed}) == 1, where
        assert len(after) == 100 and (len(handed) == 100 or not set(handed) & set(rest)), where
        assert abs(sum(source[s] == "hdf5" for s in rest) - 0.8 * left) <= 2, where
        assert sum(source[s] == "hdf5" for s in after) == 80, where
        for name in mix.names:
            parts = [[s for s in part if source[s] == name] for part in (handed, rest, after)]
            assert goes_on(parts, passes[name]), f"{where}: {name}'s pass does not go on where it was"


@pytest.fixture(scope="module")
def rank_runs(packs, tmp_path_factory) -> dict:
    """The rank launches of the tests below, {run: each rank's record}. make_loader's cases and
    StatefulDataLoader's run in the same processes, one after the other (their cases and state
    files are named apart), and so do 3 ranks' save and resume."""
    a, b = tmp_path_factory.mktemp("from2"), tmp_path_factory.mktemp("from3")
    runs = {"save 2x2": run_ranks("save+sdl-save", a, packs, world_size=2, workers=2)}
    # 3 ranks save theirs and resume the 2 ranks' states: records keyed apart (full, heads; fresh, stops)
    runs["save 3x1"] = runs["resume 3x1 gloo"] = run_ranks("save+sdl-save+resume+sdl-resume", b, packs, world_size=3,
                                                         workers=1, gloo=True, states=a)
    runs["resume 2x2 gloo"] = run_ranks("resume+reweight", b, packs, world_size=2, workers=2, gloo=True)
    runs["resume 1x0"], runs["sdl-resume 1"] = launch(packs, 1, [Step("resume", a, 0), Step("sdl-resume", b, 0)])
    return runs


def test_a_state_resumes_on_fewer_more_and_non_divisor_ranks_and_workers(rank_runs, packs):
    saved2, resumed3, saved3 = rank_runs["save 2x2"], rank_runs["resume 3x1 gloo"], rank_runs["save 3x1"]
    check_resumes(saved2, rank_runs["resume 1x0"], "2x2 -> 1x0")
    check_resumes(saved2, resumed3, "2x2 -> 3x1 gloo")
    check_resumes(saved3, rank_runs["resume 2x2 gloo"], "3x1 -> 2x2 gloo")
    check_reweighted(saved3, rank_runs["resume 2x2 gloo"], Path(packs))
    for case in SAMPLER_CASES:  # elastic determinism: one global order on 1, 2 and 3 ranks
        on_two = in_steps(interleaved([flat(r[case]["full"]) for r in saved2])[:100], case, 2, 3)
        assert in_steps(interleaved([flat(r[case]["fresh"][0]) for r in resumed3])[:100], case, 2, 3) == on_two
        assert in_steps(interleaved([flat(r[case]["full"]) for r in saved3])[:100], case, 2, 3) == on_two


@pytest.mark.parametrize("case", CASES)
def test_a_state_saved_after_an_elastic_resume_resumes_again(packs, case):
    """2 ranks -> 3 ranks (a state saved mid-way) -> 1 rank with 2 workers: every sample once."""
    handed, state = [], None
    for world_size, workers, take in ((2, 0, 3), (3, 2, 2)):
        states = []
        for rank in range(world_size):
            loader = build(packs, case, workers, rank, world_size)
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            batches = iter(loader)
            handed += flat(next(batches) for _ in range(take))
            states.append(loader.state_dict())
            del batches
        state = states[0]
        assert all(s == state for s in states), "every rank saves the same state"
    last = build(packs, case, 2, 0, 1)
    last.load_state_dict(torch.load(save_to_bytes(state), weights_only=True))
    rest = flat(last)
    assert sorted(set(handed) | set(rest)) == sorted(set(flat(build(packs, case, 0))))
    assert not set(handed) & set(rest) and len(rest) == len(set(rest))
    assert len(handed) - len(set(handed)) < 3  # 3 ranks pad with 2 repeats at most


def test_torchdata_resumes_a_stream_on_other_ranks(rank_runs):
    """StatefulDataLoader over WDSDataset with 0, 1 and 2 workers: rank 0's state, 2 ranks -> 3
    (one gloo run) and 3 ranks -> 1, as make_loader's (2 workers pool their counts as they start)."""
    check_resumes(rank_runs["save 2x2"], rank_runs["resume 3x1 gloo"], "2 -> 3 gloo", SDL_CASES)
    check_resumes(rank_runs["save 3x1"], rank_runs["sdl-resume 1"], "3 -> 1", SDL_CASES)


@pytest.mark.parametrize("case", SDL_CASES[:2] + ("sdl-stream-3",))
def test_a_stream_state_saved_after_a_torchdata_elastic_resume_resumes_again(packs, case):
    """2 ranks -> 3 ranks (rank 0's state saved mid-way) -> 1 rank: every sample once; also
    with 3 workers per rank."""
    handed, state = [], None
    for world_size, take in ((2, 3), (3, 2)):
        for rank in range(world_size):
            loader, data = stateful(packs, case, rank, world_size)
            if state is not None:
                loader.load_state_dict(state)
            data.set_epoch(0)
            batches = iter(loader)
            handed += flat(next(batches) for _ in range(take))
            rank_state = loader.state_dict()
            del batches
            if rank == 0:
                saved = rank_state
        state = saved
    loader, data = stateful(packs, case, 0, 1)
    loader.load_state_dict(torch.load(save_to_bytes(state), weights_only=True))
    rest = flat(epoch_of(loader, data, 0))
    assert sorted(set(handed) | set(rest)) == sorted(set(flat(build(packs, "stream", 0))))
    assert not set(handed) & set(rest) and len(rest) == len(set(rest))
    assert len(handed) - len(set(handed)) < 3  # 3 ranks pad with 2 repeats at most


def test_torchdata_resumes_several_workers_on_their_ranks_and_refuses_one_workers_state_alone(packs):
    handed, states, full = [], [], []
    for rank in range(2):
        loader, data = stateful(packs, "sdl-stream-2", rank, 2)
        full.append(flat(epoch_of(loader, data, 0)))
        data.set_epoch(0)
        batches = iter(loader)
        handed.append(flat(next(batches) for _ in range(3)))
        states.append(loader.state_dict())
        del batches
    for rank in range(2):  # the same world: rank 0's state is every rank's (each worker's count is the same)
        loader, data = stateful(packs, "sdl-stream-2", rank, 2)
        loader.load_state_dict(states[0])
        assert handed[rank] + flat(epoch_of(loader, data, 0)) == full[rank]
    # One worker's state alone, on other ranks, where no peers pool theirs (here, the main process)
    alone = states[0]["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    data = WDSDataset(Path(packs) / "d.wds", decode="raw", shuffle=16, seed=SEED, rank=0, world_size=3)
    data.load_state_dict(alone)
    with pytest.raises(ValueError, match="one DataLoader worker's of 2 .* saved on 2 rank\\(s\\); here there are "
                                         "3 rank\\(s\\) with 1 worker.* StatefulDataLoader\\(num_workers=2\\)"):
        list(data)


def test_torchdata_workers_started_by_spawn_pool_their_counts(packs):
    """2 ranks x 2 forked workers -> 1 rank x 2 spawned workers: the rest is every sample not handed out."""
    handed, state = [], None
    for rank in range(2):
        loader, data = stateful(packs, "sdl-stream-2", rank, 2)
        data.set_epoch(0)
        batches = iter(loader)
        handed += flat(next(batches) for _ in range(3))
        state = loader.state_dict() if rank == 0 else state
        del batches
    loader, data = stateful(packs, "sdl-stream-2-spawn", 0, 1)
    loader.load_state_dict(state)
    rest = flat(epoch_of(loader, data, 0))
    assert sorted(handed + rest) == sorted(set(flat(build(packs, "stream", 0))))


def save_to_bytes(state: dict):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("kind", [ShuffleSampler, BlockShuffleSampler])
def test_torchdata_resumes_a_sampler_on_another_world_size(packs, kind):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = readers.LMDBDataset(Path(packs) / "d.lmdb", decode="raw")

    def loader(rank, world_size):
        sampler = kind(data, seed=SEED, rank=rank, world_size=world_size)
        return StatefulDataLoader(data, BATCH, sampler=sampler, num_workers=2, collate_fn=sample_ids)

    handed, states = [], []
    for rank in range(3):
        saving = loader(rank, 3)
        batches = iter(saving)
        handed += flat(next(batches) for _ in range(4))
        states.append(saving.state_dict())
        del batches
    rest = []
    for rank in range(2):
        resuming = loader(rank, 2)
        resuming.load_state_dict(states[0])
        rest.append(flat(resuming))
    assert len(rest[0]) == len(rest[1])
    assert sorted(handed + interleaved(rest)[:100 - len(handed)]) == sorted(set(flat(loader(0, 1))))


def test_a_state_is_a_few_hundred_bytes_at_imagenet_scale():
    class ImageNet:
        def __len__(self):
            return 1_281_167

    for sampler in (ShuffleSampler(ImageNet(), rank=3, world_size=8), BlockShuffleSampler(ImageNet(), rank=3,
                                                                                            world_size=8)):
        batches = iter(sampler)
        for _ in range(1000):
            next(batches)
        state = sampler.state_dict()
        assert state["position"] == 1000 and len(json.dumps(state)) < 400
        elsewhere = type(sampler)(ImageNet(), rank=0, world_size=5)
        elsewhere.load_state_dict(json.loads(json.dumps(state)))
        assert len(elsewhere) == -(-(1_281_167 - 8000) // 5)


# States that the packer before the keyed orders saved (sampler state version 1), verbatim.
OLD_SHUFFLE_STATE = {"kind": "ShuffleSampler", "version": 1, "dataset": "100 samples", "seed": 3, "shuffle": True,
                     "drop_last": False, "world_size": 2, "epoch": 1, "start": 0, "position": 10}
OLD_BLOCK_STATE = {"kind": "BlockShuffleSampler", "version": 1, "dataset": "100 samples", "seed": 3,
                   "shuffle": True, "block_size": 64, "window": 16, "world_size": 2, "epoch": 1, "start": 0,
                   "position": 10}
OLD_LOADER_STATE = {"kind": "EpochLoader", "version": 1, "batch_size": 4, "drop_last": True, "epoch": 0,
                    "batches": 2, "sampler": {"kind": "ShuffleSampler", "version": 1,
                                              "dataset": "40 samples of split 'all', 4 classes, crc32 232386cd",
                                              "seed": 3, "shuffle": True, "drop_last": True, "world_size": 1,
                                              "epoch": 0, "start": 0, "position": 8}, "dataset": None}


def test_a_state_saved_under_the_stored_permutations_is_refused_naming_its_version(tmp_path):
    class Records:
        def __len__(self):
            return 100

    for kind, old in ((ShuffleSampler, OLD_SHUFFLE_STATE), (BlockShuffleSampler, OLD_BLOCK_STATE)):
        sampler = kind(Records(), seed=3, rank=0, world_size=2)
        with pytest.raises(ValueError, match="state is of version 1, saved by an earlier packer whose order was "
                                             r"another; this packer's \(version 2\).*Start its epoch afresh"):
            sampler.load_state_dict(old)
        assert sampler.state_dict()["position"] == 0 and sampler.pass_start() == 0  # nothing of it was taken
    tree = class_sorted_tree(tmp_path / "src", classes=4, per_class=10)
    packed = tmp_path / "d.hdf5"
    pack(str(tree), "hdf5", str(packed), progress=False, workers=1)
    loader = make_loader(readers.open_dataset(packed, decode="raw"), 4, workers=0, seed=3)
    with pytest.raises(ValueError, match="ShuffleSampler.load_state_dict: this state is of version 1"):
        loader.load_state_dict(OLD_LOADER_STATE)


def test_a_stream_state_with_a_damaged_history_is_refused_with_what_it_needs(packs):
    loader = build(packs, "stream", 0, 0, 2)
    batches = iter(loader)
    next(batches)
    state = build(packs, "stream", 0, 0, 3)
    state.load_state_dict(loader.state_dict())
    saved = state.state_dict()
    assert saved["dataset"]["position"]["history"][0]["world_size"] == 2  # resumed on 3: the 2 ranks' pass
    assert len(json.dumps(saved)) < 1000
    saved["dataset"]["position"]["history"][0]["batches"] = -1
    with pytest.raises(ValueError, match="each pass of the history needs the ints world_size, workers, batches"):
        build(packs, "stream", 0, 0, 3).load_state_dict(saved)


def test_a_resumed_streams_plan_is_worked_out_once_before_its_workers_start(packs):
    """The rank's plan after a pass on other ranks (a replay of the saved streams' buffers) is
    worked out by the loader's process as a pass starts, for its forked workers to use, not
    again in each; a pickled dataset (a spawned worker's) carries none and works it out."""
    from readers.wds import pass_plan
    from readers.wds_elastic import rank_plan

    loader = build(packs, "stream", 0, 0, 2)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    del batches
    resumed = build(packs, "stream", 2, 1, 3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    batches = iter(resumed)
    first = next(batches)
    data = resumed.dataset
    epoch, rank, world_size, history, plan = data._planned
    assert (epoch, rank, world_size) == (0, 1, 3) and history[0]["world_size"] == 2
    assert plan == rank_plan(data, 1, 3, history) and pass_plan(data, 1, 3, history) is plan
    assert pickle.loads(pickle.dumps(data))._planned is None
    # The workers' batches are the plan's (every sample once over a whole resume: the tests above).
    assert len(first) == BATCH
    del batches


def test_the_resume_benchmark_times_every_order_and_measures_the_stream_drift():
    done = subprocess.run([sys.executable, "-m", "benchmarks.resume", "--records", "20000", "--repeats", "1"],
                          cwd=HERE.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    timed = {row["order"]: row for row in rows if "ratio" in row}
    assert set(timed) == {"random", "block", "stream"} and all(row["ratio"] > 0 for row in timed.values())
    drift = [row for row in rows if "drift_from" in row]
    assert len(drift) == 3 and all(0 < row["mean_moved"] < 1 for row in drift)


def test_every_resumable_row_of_make_loaders_table_is_a_case_here():
    """A new row of readers.loader.SAMPLERS is tested here by adding its case (build() makes it)."""
    from readers.loader import SAMPLERS

    stateless = {"distributed", "plain"}  # torch's own samplers: no state to resume
    assert {name for name, _, _ in SAMPLERS} - stateless == set(SAMPLER_CASES)


if __name__ == "__main__":
    rank_main(PHASES)
