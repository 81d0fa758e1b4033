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

from readers import LMDBDataset, Mix, WDSDataset, for_workers, make_loader  # noqa: E402
from readers._state_limits import MAX_HISTORY, MAX_WORKERS, MAX_WORLD_SIZE  # noqa: E402

from conftest import packed_three_ways  # noqa: E402
from test_elastic import SEED, build  # noqa: E402
from test_stateful_workers import stateful  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

ORDERS = ("random", "block", "stream")  # over LMDB (shuffled storage), HDF5, WDS shards


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    return packed_three_ways(tmp_path_factory.mktemp("limits"))


def loader_of(root: str, order: str, rank: int = 0, world_size: int = 1, workers: int = 0):
    """make_loader's loader over the order's pack, on rank of world_size (tests/test_elastic.py's)."""
    return build(root, order, workers, rank, world_size)


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


def stream_mixture(root: str, rank: int, world_size: int):
    """A stream mixture (the LMDB pack and the WDS shards, 0.7/0.3) on rank of world_size."""
    root = Path(root)
    mix = Mix({"lmdb": LMDBDataset(root / "d.lmdb", decode="raw"),
               "web": WDSDataset(root / "d.wds", decode="raw", shuffle=4, seed=SEED, rank=rank,
                                 world_size=world_size)}, weights={"lmdb": 0.7, "web": 0.3}, seed=SEED, epoch_size=100)
    mix.sampler.rank, mix.sampler.world_size = rank, world_size
    return mix


def mix_loader(root: str, rank: int, world_size: int):
    """make_loader's loader over stream_mixture, without workers."""
    return make_loader(stream_mixture(root, rank, world_size), 5, workers=0, seed=SEED, drop_last=False)


def mix_sdl(root: str, rank: int, world_size: int, workers: int):
    """(a StatefulDataLoader over stream_mixture, the mixture, told the batch size)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    mix = stream_mixture(root, rank, world_size)
    mix.batching(5, False)
    mix.set_epoch(0)
    return StatefulDataLoader(mix, 5, num_workers=workers), mix


def mix_stream_state(root: str) -> dict:
    """A stream mixture's state saved on 3 ranks after a resume from 2: its stream's base
    holds a per-rank segment of the stream's history."""
    loader = mix_loader(root, 0, 3)
    loader.load_state_dict(saved(mix_loader(root, 0, 2)))
    state = saved(loader, 1)
    assert state["dataset"]["anchor"]["bases"]["web"]["histories"]
    return state


def sdl_state(root: str, order: str, workers: int, take: int = 2) -> dict:
    """Rank 0 of 2's StatefulDataLoader state over the order after `take` batches."""
    loader, ordered = sdl_loader(root, order, workers, 0, 2)
    ordered.set_epoch(0)
    return saved(loader, take)


def sdl_loader(root: str, order: str, workers: int, rank: int = 0, world_size: int = 1):
    """(a StatefulDataLoader over the order, what set_epoch is called on): tests/test_stateful_workers.py's."""
    return stateful(root, f"sdl-{order}", workers, rank, world_size)


def first_batch(loader) -> None:
    """Where a loaded state is used: the next pass's first batch (or its end)."""
    next(iter(loader), None)


# -- The numbers of issue's broken states: each refused, naming the field, before anything is built.

def test_a_stream_state_naming_a_billion_ranks_is_refused_before_dealing_to_them(packs):
    state = elastic_stream_state(packs)
    top = json.loads(json.dumps(state))
    top["dataset"]["world_size"] = 10**9
    with pytest.raises(ValueError, match=f"world_size must be an int >= 1, got 1000000000 \\(and at most "
                                         f"{MAX_WORLD_SIZE}\\)"):
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
    with pytest.raises(ValueError, match=f"position's: workers must be an int >= 1, got 1000000000000 \\(and at most "
                                         f"{MAX_WORKERS}\\)"):
        loader_of(packs, "stream", 0, 3).load_state_dict(state)


def test_for_workers_refuses_a_billion_saved_workers(packs):
    state = sdl_state(packs, "random", 2)
    state["_snapshot"]["_main_snapshot"]["_num_workers"] = 10**9
    with pytest.raises(ValueError, match=f"_num_workers must be an int >= 0, got 10+ \\(and at most {MAX_WORKERS}"):
        for_workers(state, 3)
    with pytest.raises(ValueError, match=f"num_workers must be an int >= 0, got 10+ \\(and at most {MAX_WORKERS}"):
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
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got 1180591620717411303424 \\(and at most "
                                         "4294967295\\)"):
        loader_of(packs, order).load_state_dict(state)
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got .* \\(and at most 4294967295\\)"):
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


# -- The fuzz: random edits of real saved states, each loaded within 1 s and 100 MB or refused.

FUZZ_SECONDS, FUZZ_BYTES = 1.0, 100 << 20
CASES_PER_SURFACE = 30  # x 3 orders x 3 ways of loading, and a stream mixture's make_loader and StatefulDataLoader
HUGE = (-1, 0, 1, 2, 2**31, 10**9, 10**12, 2**63, 2**70, -2**70, MAX_WORLD_SIZE, MAX_WORLD_SIZE + 1,
        MAX_WORKERS, MAX_WORKERS + 1, 2**32, 2**32 - 1)
FOREIGN = ("x", None, 1.5, True, [], {}, [1, 2], "0" * 1000, float("nan"))
PACKER_KINDS = ("ShuffleSampler", "BlockShuffleSampler", "WDSDataset", "MixStream")


def paths(value, at=(), owned=False):
    """Every (path, value, packer-owned) in a state: dict keys and list places."""
    owned = owned or (isinstance(value, dict) and value.get("kind") in PACKER_KINDS)
    yield at, value, owned
    if len(at) > 12:  # inside an earlier edit's nesting
        return
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from paths(child, at + (key,), owned)


def mutated(state: dict, rng: random.Random, torchdata: bool) -> tuple[dict, str]:
    """A copy of state with 1 to 3 random edits, and what they were. In a StatefulDataLoader's
    state, numbers and types are edited only in packer's parts (torchdata's own counters are
    torchdata's to check); its structure is attacked anywhere."""
    state = json.loads(json.dumps(state))
    done = []
    for _ in range(rng.randint(1, 3)):
        places = [(at, value, owned) for at, value, owned in paths(state) if at]
        at, value, owned = rng.choice(places)
        parent = state
        for key in at[:-1]:
            parent = parent[key]
        ops = ["deep", "long", "drop", "extra"] + (["number", "foreign", "history"] * 3 if owned or not torchdata
                                                    else [])
        op = rng.choice(ops)
        if op == "number":
            new = rng.choice(HUGE + (rng.randrange(-10**6, 10**6),))
        elif op == "foreign":
            new = rng.choice(FOREIGN)
        elif op == "deep":
            new = nested(rng.choice((30, 500, 100_000)), value)
        elif op == "long":
            new = ([value] * rng.choice((17, 1000, 100_000)) if not isinstance(value, list)
                   else (value or [0]) * rng.choice((2, 17, 10_000)))
        elif op == "history":
            new = {"world_size": rng.choice(HUGE), "workers": rng.choice(HUGE), "batches": rng.choice(HUGE),
                   "batch_size": rng.choice(HUGE), "drop_last": rng.choice((True, False))}
            new = [new] * rng.choice((1, 2, 16, 17, 1000))
            at = at[:-1] + ("history",)
            parent = parent if isinstance(parent, dict) else state
        if op == "drop":
            del parent[at[-1]]
        elif op == "extra":
            (parent if isinstance(parent, dict) else state)["junk"] = 1
        else:
            parent[at[-1]] = new
        done.append(f"{op} at {'/'.join(map(str, at))}")
    return state, "; ".join(done)


def fuzz_side(job: dict) -> dict:
    """Every case's outcome: "loaded", "refused", or a failure (another error, over time or memory)."""
    root, rng = job["root"], random.Random(job["seed"])
    surfaces = {}
    for order in ORDERS:
        loader = elastic_stream_state(root) if order == "stream" else saved(loader_of(root, order, 0, 2))
        surfaces[f"{order} make_loader"] = (loader, lambda state, order=order: use_loader(root, order, state), False)
        part = loader["dataset"] if order == "stream" else loader["sampler"]
        surfaces[f"{order} own state"] = (part, lambda state, order=order: use_own(root, order, state), False)
        surfaces[f"{order} StatefulDataLoader"] = (sdl_state(root, order, 2),
                                                   lambda state, order=order: use_sdl(root, order, state), True)
    mixed = mix_stream_state(root)
    surfaces["stream mixture make_loader"] = (mixed, lambda state: use_mix(root, state), False)
    surfaces["stream mixture StatefulDataLoader"] = (saved(mix_sdl(root, 0, 2, 2)[0], 3),
                                                     lambda state: use_mix_sdl(root, state), True)
    signal.signal(signal.SIGALRM, overtime)
    cap_address_space(2 << 30)
    outcomes = []
    for name, (state, use, torchdata) in surfaces.items():
        for case in range(CASES_PER_SURFACE + 1):  # case 0: the state as saved
            edited, what = (state, "as saved") if case == 0 else mutated(state, rng, torchdata)
            outcomes.append({"surface": name, "edit": what, **measured(use, edited)})
    return {"outcomes": outcomes}


def use_loader(root: str, order: str, state: dict):
    loader = loader_of(root, order, 0, 3)
    return lambda: (loader.load_state_dict(state), first_batch(loader))


def use_mix(root: str, state: dict):
    loader = mix_loader(root, 0, 3)
    return lambda: (loader.load_state_dict(state), first_batch(loader))


def use_mix_sdl(root: str, state: dict):
    loader, mix = mix_sdl(root, 0, 3, 0)
    return lambda: (loader.load_state_dict(for_workers(state, 0, mix)), first_batch(loader))


def use_own(root: str, order: str, state: dict):
    target = loader_of(root, order, 0, 3)
    target = target.dataset if order == "stream" else target.sampler
    return lambda: (target.load_state_dict(state), next(iter(target), None))


def use_sdl(root: str, order: str, state: dict):
    loader, ordered = sdl_loader(root, order, 0, 0, 3)
    ordered.set_epoch(0)
    return lambda: (loader.load_state_dict(for_workers(state, 0)), first_batch(loader))


class Overtime(BaseException):
    """Raised by SIGALRM in a case that runs far past its second."""


def overtime(signum, frame):
    raise Overtime()


def cap_address_space(headroom: int) -> None:
    """Cap this process's address space at what it maps now plus headroom: a case that
    allocated without bound fails with MemoryError instead of taking the machine."""
    size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


def status_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def measured(use, state) -> dict:
    """use(state)'s outcome, its seconds and its growth of resident memory (peak over start)."""
    run = use(state)  # the loader is built before the clock starts: only loading and a first batch are timed
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident size
    rss = status_kb("VmRSS")
    signal.setitimer(signal.ITIMER_REAL, 20 * FUZZ_SECONDS)
    start = time.perf_counter()
    try:
        run()
        outcome = "loaded"
    except ValueError:
        outcome = "refused"
    except (Exception, Overtime) as exc:  # noqa: BLE001 - any other error is what the fuzz looks for
        outcome = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {"outcome": outcome, "seconds": time.perf_counter() - start, "grew": (status_kb("VmHWM") - rss) * 1024}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures memory with /proc (Linux)")
def test_random_edits_of_real_states_load_within_a_second_and_100_mb_or_are_refused(packs, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"root": packs, "seed": 50, "out": str(tmp_path / "out.json")}))
    done = subprocess.run([sys.executable, __file__, "fuzz", str(job)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    outcomes = json.loads((tmp_path / "out.json").read_text())["outcomes"]
    assert len(outcomes) == 11 * (CASES_PER_SURFACE + 1)
    bad = [o for o in outcomes if o["outcome"] not in ("loaded", "refused") or o["seconds"] > FUZZ_SECONDS
           or o["grew"] > FUZZ_BYTES]
    assert not bad, "\n".join(f"{o['surface']}, {o['edit']}: {o['outcome']}, {o['seconds']:.2f} s, "
                              f"{o['grew'] >> 20} MB" for o in bad)
    assert all(o["outcome"] == "loaded" for o in outcomes if o["edit"] == "as saved")
    refused = sum(o["outcome"] == "refused" for o in outcomes)
    assert len(outcomes) / 2 < refused < len(outcomes)  # most edits are refused, some still load


if __name__ == "__main__":
    job = json.loads(Path(sys.argv[2]).read_text())
    Path(job["out"]).write_text(json.dumps({"fuzz": fuzz_side}[sys.argv[1]](job)))
