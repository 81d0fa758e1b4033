"""A torchdata StatefulDataLoader state rewritten for another number of DataLoader workers.

torchdata asserts that a state loads only into a loader with the worker count it was
saved with, and its layout depends on that count: with K >= 1 workers, a snapshot of the
main process (the sampler's state) and one per worker (the dataset's state in it); with
0, one flat dict. Neither the samplers' nor WDSDataset's order depends on the worker
count once a pass is resumed, so only these need rewriting:

- the main part (sampler, seeds, batches yielded) is carried over as it is: the sampler's
  state is as of the last batch handed out, whatever the workers;
- a map-style dataset's worker states are all alike (its order is the sampler's): each
  new worker gets that one;
- WDSDataset's worker states each hold one stream's count of samples yielded to batches
  handed out; together they are the rank's position, so they are pooled here into one
  pass of the stream's history (readers.wds_elastic), and every new worker starts its
  stream of the rest of the epoch, dealt anew, at 0;
- a stream mixture's (readers.Mix over a WDSDataset) worker states each hold one worker's
  next batch and its chains' counts: they are pooled into one state for every new worker,
  whose mixture folds the chains into each stream's base (readers._mix_stream_state).

The layout is torchdata's private detail: it is checked key by key, against the torchdata
release it was read from, and anything else is refused.
"""
from __future__ import annotations

import copy
import importlib.metadata

import torch

from ._mix_stream_state import pooled_workers
from ._state_limits import MAX_WORKERS, MAX_WORLD_SIZE, bounded_int, check_shape, shown
from ._wds_resume import checked_position
from .wds_elastic import appended, checked_history

CHECKED_TORCHDATA = ("0.11",)  # releases whose StatefulDataLoader state layout this was read from
MAIN_KEYS = {"_sampler_iter_state", "_index_sampler_state", "_sampler_iter_yielded", "_IterableDataset_len_called",
             "_shared_seed"}  # with "_num_workers" and "_base_seed" in a worker loader's main snapshot
SINGLE_KEYS = MAIN_KEYS | {"_num_yielded", "_iterator_finished", "fetcher_state", "dataset_state"}
LOADER_KEYS = {"_snapshot", "_steps_since_snapshot", "_iterator_finished"}
SNAPSHOT_KEYS = {"_snapshot_step", "_last_yielded_worker_id", "_main_snapshot", "_worker_snapshots"}
WORKER_KEYS = {"worker_id", "fetcher_state", "dataset_state"}
NONE = type(None)
VALUE_TYPES = {  # the types torchdata 0.11 saves under each key it owns: any other was altered
    "_sampler_iter_state": (dict, NONE), "_index_sampler_state": (dict, NONE), "_sampler_iter_yielded": (int,),
    "_IterableDataset_len_called": (int, NONE), "_shared_seed": (int, NONE), "_base_seed": (int,),
    "_num_workers": (int,), "_num_yielded": (int,), "_iterator_finished": (bool,), "fetcher_state": (dict, NONE),
    "dataset_state": (dict, NONE), "worker_id": (int,), "_snapshot_step": (int,), "_last_yielded_worker_id": (int,),
    "_steps_since_snapshot": (int,), "_snapshot": (dict,), "_main_snapshot": (dict,), "_worker_snapshots": (dict,)}
FRESH_FETCHER = {"dataset_iter_state": None, "fetcher_ended": False}  # an iterable dataset's, not yet ended


def for_workers(state: dict, num_workers: int, dataset=None) -> dict:
    """The StatefulDataLoader state `state` (saved with any number of workers, 0 included)
    rewritten so that a StatefulDataLoader with `num_workers` workers loads it and resumes
    the same epoch exactly: for packer's samplers and WDSDataset's stream, on these ranks
    or others (docs/resume.md). The same worker count returns `state` itself, but for a
    stream mixture's on another rank or world size.

    Raises ValueError for a state that is not a StatefulDataLoader's, of a layout other
    than torchdata 0.11's, saved between snapshots (snapshot_every_n_steps above 1), or
    over an IterableDataset other than WDSDataset or a stream mixture. A stream mixture's
    (readers.Mix over a WDSDataset) needs `dataset`, the mixture the loader reads, where
    the loader has workers: the mixture loads the pooled state here too, so that the
    workers of its later epochs, started from it, go on from the same fold."""
    bounded_int(num_workers, "num_workers", "readers.for_workers", 0, MAX_WORKERS)
    check_torchdata()
    check_shape(state, "readers.for_workers")
    saved = parts(state)
    if saved["workers"] == num_workers and not other_ranks(saved["datasets"][0], dataset):
        return state
    if saved["steps_since"]:
        raise ValueError(f"readers.for_workers: the state was saved {saved['steps_since']} batch(es) after "
                         "StatefulDataLoader's last snapshot (snapshot_every_n_steps above 1), and a loader with "
                         "other workers would skip batches of another deal: save it at a snapshot (keep the "
                         "default snapshot_every_n_steps=1), or resume with the workers it was saved with")
    workers = new_worker_states(saved["datasets"], saved["fetchers"], max(1, num_workers))
    if isinstance(workers[0][1], dict) and "pooled" in workers[0][1]:
        hold_fold(dataset, workers[0][1], num_workers)
    main = copy.deepcopy(saved["main"])
    base_seed = main.pop("_base_seed", None)  # a worker loader's; the flat form has none
    if num_workers == 0:
        fetcher, dataset = workers[0]
        return {**main, "_num_yielded": saved["step"], "_iterator_finished": saved["finished"],
                "fetcher_state": fetcher, "dataset_state": dataset}
    # A worker loader's base seed is kept; for a flat one's, one is drawn as a fresh DataLoader draws it.
    base_seed = int(torch.empty((), dtype=torch.int64).random_().item()) if base_seed is None else base_seed
    return {"_snapshot": {"_snapshot_step": saved["step"],
                          "_last_yielded_worker_id": num_workers - 1,  # worker 0 is asked first, as in a new pass
                          "_main_snapshot": {**main, "_num_workers": num_workers, "_base_seed": base_seed},
                          "_worker_snapshots": {f"worker_{i}": {"worker_id": i, "fetcher_state": fetcher,
                                                                "dataset_state": dataset}
                                                for i, (fetcher, dataset) in enumerate(workers)}},
            "_steps_since_snapshot": 0, "_iterator_finished": saved["finished"]}


def other_ranks(saved_dataset, dataset) -> bool:
    """Whether a stream mixture's worker state goes to a mixture on another rank or world
    size: it is pooled then, as for other workers (a worker's own state resumes only where
    it was saved)."""
    own = saved_dataset.get("worker") if isinstance(saved_dataset, dict) else None
    return (type(dataset).__name__ == "MixStream" and isinstance(own, dict)
            and (own.get("rank"), saved_dataset.get("world_size")) != dataset.world())


def hold_fold(dataset, pooled: dict, num_workers: int) -> None:
    """Load a stream mixture's pooled state into the loader's mixture: a DataLoader starts
    each epoch's workers from it, and only its state says where the fold left each stream."""
    if dataset is None:
        if num_workers == 0:
            return  # the loader loads it into the mixture itself
        raise ValueError("readers.for_workers: this is a stream mixture's state (readers.Mix over a WDSDataset), "
                         "whose later epochs' workers start from the mixture the loader reads: pass it, "
                         "for_workers(state, num_workers, dataset=mix), so it goes on from where the state stopped")
    if type(dataset).__name__ != "MixStream":
        raise ValueError(f"readers.for_workers: dataset must be the stream mixture the state was saved over (a "
                         f"readers.Mix with a WDSDataset source), got {type(dataset).__name__}")
    dataset.load_state_dict(copy.deepcopy(pooled))


def check_torchdata() -> None:
    """Refuse where an installed torchdata is a release whose layout was not read here."""
    try:
        version = importlib.metadata.version("torchdata")
    except importlib.metadata.PackageNotFoundError:
        return  # rewriting a saved state needs no torchdata; loading it will
    if ".".join(version.split(".")[:2]) not in CHECKED_TORCHDATA:
        raise ValueError(f"readers.for_workers: torchdata {version} is installed, and its StatefulDataLoader state "
                         f"layout (a private detail) was read here from torchdata {', '.join(CHECKED_TORCHDATA)} "
                         "only: install torchdata 0.11 (`pip install 'torchdata~=0.11.0'`), or resume with the "
                         "workers the state was saved with, or through readers.make_loader, which resumes with any")


def parts(state) -> dict:
    """A saved state's pieces, whatever its worker count: "workers" (0 for the flat form),
    "main" (the sampler's part), "step" (batches yielded), "steps_since" (since the
    snapshot), "finished", and each saved worker's "datasets" and "fetchers" states."""
    if isinstance(state, dict) and state.get("kind") == "EpochLoader":
        raise ValueError("readers.for_workers: this is readers.make_loader's loader state, which resumes with any "
                         "number of workers as it is: load it into make_loader's loader")
    if isinstance(state, dict) and set(state) == SINGLE_KEYS:
        check_types(state)
        return {"workers": 0, "main": {key: state[key] for key in MAIN_KEYS}, "step": count(state, "_num_yielded"),
                "steps_since": 0, "finished": state["_iterator_finished"],
                "datasets": [state["dataset_state"]], "fetchers": [state["fetcher_state"]]}
    if not (isinstance(state, dict) and set(state) == LOADER_KEYS and isinstance(state["_snapshot"], dict)
            and set(state["_snapshot"]) == SNAPSHOT_KEYS):
        raise ValueError(layout_message(state))
    snapshot = state["_snapshot"]
    main = snapshot["_main_snapshot"]
    if not (isinstance(main, dict) and set(main) == MAIN_KEYS | {"_num_workers", "_base_seed"}):
        raise ValueError(layout_message(main, "its _main_snapshot"))
    for part in (state, snapshot, main):
        check_types(part)
    workers = count(main, "_num_workers", MAX_WORKERS)
    snapshots = snapshot["_worker_snapshots"]
    keys = [f"worker_{i}" for i in range(workers)]
    if not (workers >= 1 and isinstance(snapshots, dict) and set(snapshots) == set(keys)
            and all(isinstance(snapshots[k], dict) and set(snapshots[k]) == WORKER_KEYS
                    and snapshots[k]["worker_id"] == i for i, k in enumerate(keys))):
        raise ValueError(f"readers.for_workers: the state's _worker_snapshots are not one dict {sorted(WORKER_KEYS)} "
                         f"for each of its {workers} workers, keyed worker_0 on: it was not saved by torchdata "
                         f"{', '.join(CHECKED_TORCHDATA)}'s StatefulDataLoader, or was altered since")
    for k in keys:
        check_types(snapshots[k], f"_worker_snapshots/{k}/")
    return {"workers": workers, "main": {key: main[key] for key in MAIN_KEYS | {"_base_seed"}},
            "step": count(snapshot, "_snapshot_step"), "steps_since": count(state, "_steps_since_snapshot"),
            "finished": state["_iterator_finished"],
            "datasets": [snapshots[k]["dataset_state"] for k in keys],
            "fetchers": [snapshots[k]["fetcher_state"] for k in keys]}


def check_types(part: dict, where: str = "") -> None:
    """Refuse a value of a key torchdata owns whose type is not the one torchdata saves there:
    torchdata would fail on it later, with an error of its own."""
    for key, value in part.items():
        allowed = VALUE_TYPES.get(key)
        if allowed is not None and type(value) not in allowed:
            raise ValueError(f"readers.for_workers: the state's {where}{key} is {shown(value)}, and torchdata "
                             f"{', '.join(CHECKED_TORCHDATA)} saves {' or '.join(t.__name__ for t in allowed)} there: "
                             "it was altered since it was saved")


def count(state: dict, key: str, most: int | None = None) -> int:
    return bounded_int(state[key], f"the state's {key}", "readers.for_workers", 0, most)


def layout_message(state, what: str = "it") -> str:
    got = shown(sorted(map(str, state))) if isinstance(state, dict) else type(state).__name__
    return (f"readers.for_workers: this is not a StatefulDataLoader state of torchdata "
            f"{', '.join(CHECKED_TORCHDATA)} ({what} has {got}; one saved with workers has {sorted(LOADER_KEYS)}, "
            f"with num_workers=0 {sorted(SINGLE_KEYS)}): pass the dict StatefulDataLoader.state_dict() returned, "
            "as it was saved")


def new_worker_states(datasets: list, fetchers: list, workers: int) -> list[tuple]:
    """(fetcher state, dataset state) for each of `workers` new workers (one for the flat form)."""
    if all(fetcher is None for fetcher in fetchers):  # a map-style dataset: its order is the sampler's
        if any(dataset != datasets[0] for dataset in datasets):
            raise ValueError("readers.for_workers: the workers saved different states of their map-style dataset, "
                             "so no one state stands for all of them: resume with the workers it was saved with")
        return [(None, copy.deepcopy(datasets[0])) for _ in range(workers)]
    kinds = {d.get("kind") if isinstance(d, dict) else None for d in datasets}
    if len(kinds) != 1 or kinds - {"WDSDataset", "MixStream"} \
            or not all(isinstance(f, dict) and set(f) == set(FRESH_FETCHER) for f in fetchers):
        raise ValueError("readers.for_workers: the state is of an IterableDataset other than readers.WDSDataset "
                         "or a readers.Mix with a stream, "
                         "whose workers' states cannot be pooled into other workers' here: resume it with the "
                         "workers it was saved with")
    if kinds == {"MixStream"}:  # every new worker folds the rank's workers' chains (readers._mix_stream_state)
        pooled = pooled_workers(datasets)
        return [(dict(FRESH_FETCHER), copy.deepcopy(pooled)) for _ in range(workers)]
    return [(dict(FRESH_FETCHER), dataset) for dataset in stream_states(datasets, workers)]


def stream_states(states: list[dict], workers: int) -> list[dict]:
    """WDSDataset states for `workers` new workers of a rank: every saved stream's count
    becomes one pass of the history, and each new stream starts the rest at 0."""
    first = {key: value for key, value in states[0].items() if key != "position"}
    if any({key: value for key, value in state.items() if key != "position"} != first for state in states):
        raise ValueError("readers.for_workers: the workers' WDSDataset states differ in more than their position "
                         "(data, seed, epoch or world size): they are not one loader's")
    positions = [checked_position(state.get("position")) for state in states]
    if all(position is None for position in positions):  # an epoch's start
        return [copy.deepcopy(states[0]) for _ in range(workers)]
    if not all(position is not None and "samples" in position and position["workers"] == len(states)
               and position["worker"] == w for w, position in enumerate(positions)):
        raise ValueError(f"readers.for_workers: the {len(states)} workers' WDSDataset positions are not each "
                         f"worker's own count of {len(states)} (got {shown(positions)}): not a StatefulDataLoader's")
    history = checked_history(positions[0].get("history", []))
    if any(position.get("history", []) != history for position in positions):
        raise ValueError("readers.for_workers: the workers' WDSDataset positions hold different histories: they "
                         "are not one loader's")
    streams = [position["samples"] for position in positions]
    if any(streams):
        world_size = bounded_int(first.get("world_size"), "world_size", "readers.for_workers: a WDSDataset state's",
                                 1, MAX_WORLD_SIZE)
        history = appended(history, {"world_size": world_size, "workers": len(streams), "streams": streams})
    if not history:  # nothing consumed: the epoch as a fresh run reads it
        return [{**copy.deepcopy(first), "position": None} for _ in range(workers)]
    return [{**copy.deepcopy(first), "position": {"rank": positions[0]["rank"], "worker": w, "workers": workers,
                                                  "samples": 0, "history": copy.deepcopy(history)}}
            for w in range(workers)]
