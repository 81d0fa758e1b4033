"""A stream mixture's saved state, checked as untrusted input, and the two ways it resumes:
exactly, on the ranks and DataLoader workers it was saved on over the same mixture; else
folded (readers._mix_chains): the chains' counts where it stopped, worked out under the
schedule it was saved with, become each stream's base, and the rest of the epoch is the
map-style schedule's elastic or reweighted resume (readers.mix.MixSampler.load_state_dict).

The state (MixStream.state_dict, with make_loader's loader's position): the mixture's
settings, "streams" (each stream source's settings), "world_size", "workers" (the loader's),
"segment" (the schedule's, as MixSampler's), "anchor", "epoch", "position". In a DataLoader
worker (torchdata's StatefulDataLoader), each worker's own: "worker" (own_state) in place
of the position, which resumes exactly; readers.for_workers pools a rank's workers' into
"pooled" (pooled_workers), which resumes folded, as a loader state on other ranks does.
"""
from __future__ import annotations

import copy

from ._mix_chains import BASE, MOST, ChainEpochs, Counts, Walk, checked_anchor, folded
from ._state_limits import MAX_EPOCH, MAX_WORKERS, MAX_WORLD_SIZE, bounded_int, shown
from .elastic import pass_length
from .ranks import worker
from .sampler import SAMPLER_STATE_VERSION, check_state, checked_count

CHANGEABLE = ("sources", "weights", "epoch_size", "streams")  # what reweight=True may change
POSITION_KEYS = {"workers", "batches", "batch_size", "drop_last"}  # make_loader's loader's position


class SavedState:
    """A MixStream state, checked against the mixture `mix` loading it: epoch, world_size,
    workers (None: not known), position, anchor, start and pass_batches of the saved pass,
    and the sampler's state of it."""

    def __init__(self, mix, state: dict, pool: dict | None = None):
        self.pool = pool  # a rank's workers' own counts (pooled_state's), for its rows of the chains
        now = mix.settings()
        check_state(state, "MixStream", {k: v for k, v in now.items() if k not in CHANGEABLE})
        who = "MixStream.load_state_dict"
        self.epoch = checked_count(state, "epoch", "MixStream", MAX_EPOCH)
        self.world_size = bounded_int(state.get("world_size"), "world_size", who, 1, MAX_WORLD_SIZE)
        workers = state.get("workers")
        self.position = checked_position(state.get("position"))
        if self.position is not None:
            workers = self.position["workers"]
        self.workers = None if workers is None else bounded_int(workers, "workers", who, 1, MAX_WORKERS)
        self.names = saved_streams(state, now)
        self.changed = [f"{k} {shown(state.get(k))} (now {shown(now[k])})" for k in CHANGEABLE
                        if state.get(k) != now[k]]
        if self.changed and not mix.view.reweight:
            raise ValueError(f"Mix: the state was saved over another mixture: {'; '.join(self.changed)}; build the Mix "
                             "as the saved run did, or pass Mix(..., reweight=True) to go on with these weights and "
                             "sources from where it stopped")
        self.anchor = checked_anchor(state.get("anchor"), self.names)
        anchor = self.anchor
        if anchor["chains"] is not None and (anchor["world_size"] != self.world_size or
                                             anchor["workers"] != (self.workers or anchor["workers"])):
            raise ValueError(f"{who}: the anchor's chains are {anchor['world_size']} rank(s) x {anchor['workers']} "
                             f"worker(s), the state's {self.world_size} x {self.workers}: it is damaged or was put "
                             "together from two states")
        self.workers = self.workers or anchor["workers"]
        ours = self.epoch == anchor["epoch"]
        self.start = anchor["start"] if ours else 0
        loader_batches = self.position["batches"] if self.position is not None else 0
        self.pass_batches = loader_batches - (anchor["skipped"] if ours else 0)
        self.sampler_state = sampler_state(mix, state, self)
        if self.pass_batches < 0 or self.pass_batches * mix.batch_size > self.length(mix) + mix.batch_size - 1:
            raise ValueError(f"{who}: the position ({loader_batches} batches) is outside its pass of epoch "
                             f"{self.epoch} (from batch {loader_batches - self.pass_batches}); it is damaged or was "
                             "put together from two states")
        self.skipped = loader_batches

    def length(self, mix) -> int:
        """Positions each saving rank took in the saved pass."""
        return pass_length(mix.sampler.count_of(self.sampler_state), self.start, self.world_size,
                           mix.sampler.drop_last)

    def exact(self, mix) -> bool:
        """Whether it resumes exactly: the same mixture on the same ranks and workers."""
        return not self.changed and (self.world_size, self.workers) == (mix.world()[1], mix.workers or self.workers)

    def folded(self, mix) -> dict:
        """The anchor of a resume on other ranks or workers, or over another mixture: each
        kept stream's chains folded into its base, the map-style schedule loaded (elastic or
        reweighted), and the pass starting where it says, every chain at 0."""
        if self.workers is None:
            raise ValueError("Mix: the state does not say how many DataLoader workers saved it (a plain DataLoader's), "
                             "so its chains cannot be dealt to other ranks or weights: resume it through the loader "
                             "it was saved with")
        chains = self.saved_chains(mix)
        bases = {}
        for s, stream in mix.streams.items():
            name = mix.names[s]
            if name in chains:
                epochs = ChainEpochs(stream, self.anchor["bases"].get(name, BASE), self.world_size, self.workers)
                bases[name] = folded(epochs, chains[name], name)
        mix.sampler.load_state_dict(self.sampler_state)
        epoch, start = mix.sampler._resume  # where its pass starts: the rest of the epoch, dealt to this world
        return {"epoch": epoch, "start": start, "batches": 0, "skipped": self.skipped, "world_size": None,
                "workers": None, "chains": None, "bases": bases}

    def saved_chains(self, mix) -> dict[str, list[list[int]]]:
        """Each saved stream's chains' counts where the state stopped (per worker per rank),
        walked under the schedule it was saved with."""
        sampler = copy.copy(mix.sampler)
        sampler.schedule = sampler.saved_schedule(self.sampler_state)
        sampler.count = sampler.count_of(self.sampler_state)
        order = list(self.sampler_state["sources"])
        walk = Walk(sampler, [order.index(name) for name in self.names], self.world_size, mix.batch_size,
                    mix.drop_last)
        counts = Counts(self.anchor, walk, self.names)
        out = {name: [] for name in self.names}
        for rank in range(self.world_size):
            at = counts.at(rank, self.workers, self.epoch, self.pass_batches)
            for k, name in enumerate(self.names):
                out[name].append(at[:, k].tolist())
        return out if self.pool is None else with_pooled_rows(out, self.pool, self.world_size)


def checked_position(position) -> dict | None:
    if position is None:
        return None
    who = "MixStream.load_state_dict: position's"
    if not isinstance(position, dict) or set(position) != POSITION_KEYS:
        raise ValueError(f"MixStream.load_state_dict: position must be None or make_loader's "
                         f"{{workers, batches, batch_size, drop_last}}, got {shown(position)}")
    bounded_int(position["workers"], "workers", who, 1, MAX_WORKERS)
    bounded_int(position["batches"], "batches", who, 0, MOST)
    return dict(position)


def saved_streams(state: dict, now: dict) -> list[str]:
    """The state's stream sources, in its sources' order: a kept one's settings must be
    this one's (a stream's epochs cannot go on over other shards)."""
    streams, sources = state.get("streams"), state.get("sources")
    if not isinstance(streams, dict) or not isinstance(sources, dict) or not set(streams) <= set(sources):
        raise ValueError(f"MixStream.load_state_dict: streams must be a dict of the state's stream sources' settings, "
                         f"got {shown(streams)}")
    for name, saved in streams.items():
        if name in now["sources"] and now["streams"].get(name) != saved:
            raise ValueError(f"Mix: stream source {name!r} is not the stream the state was saved over (saved "
                             f"{shown(saved)}, now {shown(now['streams'].get(name))}); its epochs cannot go on over "
                             "other shards or settings: open the saved shards as they were, or give the new data "
                             "another name in a Mix with reweight=True to start it afresh")
    return [name for name in sources if name in streams]


def sampler_state(mix, state: dict, saved: SavedState) -> dict:
    """The map-style schedule's state of the saved pass (MixSampler's), for its elastic or
    reweighted resume: the rank's positions are the batches handed out."""
    sampler = mix.sampler
    out = {"kind": "MixSampler", "version": SAMPLER_STATE_VERSION,
           **{key: state.get(key) for key in sampler.settings()}, "drop_last": sampler.drop_last,
           "world_size": saved.world_size, "epoch": saved.epoch, "start": saved.start, "position": 0,
           "segment": state.get("segment")}
    count = sampler.count_of(out)
    length = pass_length(count, min(saved.start, count), saved.world_size, sampler.drop_last)
    out["position"] = min(max(0, saved.pass_batches) * mix.batch_size, length)
    return out


WORKER_KEYS = {"rank", "worker", "workers", "start", "first", "chains"}  # a worker's own state's "worker"


def own_state(mix, state: dict) -> dict:
    """A worker's own state (MixStream.state_dict in a DataLoader worker: torchdata's
    StatefulDataLoader), checked: it resumes exactly, in the same worker of the same rank
    of the same mixture. {"epoch", "first", "anchor"}: the anchor at the worker's next round,
    its chains' counts in its own row; the mixture's schedule set to the state's segment."""
    check_state(state, "MixStream", mix.settings())
    who = "MixStream.load_state_dict: the worker's"
    epoch = checked_count(state, "epoch", "MixStream", MAX_EPOCH)
    own = state["worker"]
    if not isinstance(own, dict) or set(own) != WORKER_KEYS:
        raise ValueError(f"MixStream.load_state_dict: worker must be a dict of {', '.join(sorted(WORKER_KEYS))}, as "
                         f"state_dict() in a DataLoader worker gives it, got {shown(own)}")
    rank, world_size = mix.world()
    worker_id, workers = worker()
    saved = (bounded_int(own["rank"], "rank", who, 0, MAX_WORLD_SIZE - 1), state.get("world_size"),
             bounded_int(own["worker"], "worker", who, 0, MAX_WORKERS - 1),
             bounded_int(own["workers"], "workers", who, 1, MAX_WORKERS))
    if saved != (rank, world_size, worker_id, workers):
        raise ValueError(f"Mix: this state is DataLoader worker {saved[2]} of {saved[3]}'s on rank {saved[0]} of "
                         f"{shown(saved[1])}, loaded in worker {worker_id} of {workers} on rank {rank} of {world_size}: "
                         "a worker's own state (torchdata's StatefulDataLoader) resumes on the ranks and workers that "
                         "saved it; for others, load the loader's whole state rewritten by "
                         "readers.for_workers(state, num_workers, dataset=mix), or resume through "
                         "readers.make_loader's loader")
    names = [mix.names[s] for s in mix.streams]
    chains = own["chains"]
    if not isinstance(chains, dict) or list(chains) != names or not all(
            type(n) is int and 0 <= n <= MOST for n in chains.values()):
        raise ValueError(f"{who} chains must hold a count >= 0 for each stream source ({', '.join(names)}), got "
                         f"{shown(chains)}")
    start = bounded_int(own["start"], "start", who, 0, mix.sampler.count)
    first = bounded_int(own["first"], "first", who, 0, MOST)
    bases = checked_anchor(state.get("anchor"), names)["bases"]
    mix.sampler.schedule = mix.sampler.saved_schedule(state)
    rows = {name: [[0] * workers for _ in range(world_size)] for name in names}
    for name in names:
        rows[name][rank][worker_id] = chains[name]
    anchor = {"epoch": epoch, "start": start, "batches": first, "skipped": 0, "world_size": world_size,
              "workers": workers, "chains": rows, "bases": bases}
    return {"epoch": epoch, "first": first, "anchor": anchor}


POOL_KEYS = {"rank", "workers", "batches", "chains"}  # readers.for_workers' pool of a rank's workers' own states


def pooled_workers(states: list) -> dict:
    """One state for every new worker of a rank (readers.for_workers), from its K workers'
    own states (StatefulDataLoader's): what they share, with "pooled": the saving rank, K,
    the batches of the pass the rank had handed out, and each stream's count per worker.
    Worker w of K makes batches w, w + K, ..., so the workers whose next round is one ahead
    are a prefix, and the batches handed out are the lowest next round plus their number."""
    who = "readers.for_workers: a MixStream worker state's"
    shared = {key: value for key, value in states[0].items() if key != "worker"}
    if any({key: value for key, value in state.items() if key != "worker"} != shared for state in states):
        raise ValueError("readers.for_workers: the workers' MixStream states differ in more than their own part "
                         "(settings, epoch or anchor): they are not one loader's")
    owns = [state.get("worker") for state in states]
    workers = len(owns)
    if not all(isinstance(own, dict) and set(own) == WORKER_KEYS for own in owns):
        raise ValueError(f"{who} worker must be a dict of {', '.join(sorted(WORKER_KEYS))}, as state_dict() in a "
                         f"DataLoader worker gives it, got {shown(owns)}")
    rank = bounded_int(owns[0]["rank"], "rank", who, 0, MAX_WORLD_SIZE - 1)
    if any((own["rank"], own["worker"], own["workers"], own["start"]) != (rank, w, workers, owns[0]["start"])
           for w, own in enumerate(owns)):
        raise ValueError(f"readers.for_workers: the {workers} MixStream worker states are not workers 0 to "
                         f"{workers - 1} of {workers} of one rank's pass (got {shown(owns)}): not a "
                         "StatefulDataLoader's")
    firsts = [bounded_int(own["first"], "first", who, 0, MOST) for own in owns]
    low = min(firsts)
    ahead = [first > low for first in firsts]
    if any(first not in (low, low + workers) for first in firsts) or ahead != sorted(ahead, reverse=True):
        raise ValueError(f"readers.for_workers: the MixStream workers' next batches {firsts} are not one loader's "
                         f"(worker w of {workers} makes batches w, w + {workers}, ...): it is damaged or was put "
                         "together from two states")
    names = list(owns[0]["chains"]) if isinstance(owns[0]["chains"], dict) else None
    if names is None or not all(isinstance(own["chains"], dict) and list(own["chains"]) == names and all(
            type(n) is int and 0 <= n <= MOST for n in own["chains"].values()) for own in owns):
        raise ValueError(f"{who} chains must hold a count >= 0 for each stream source, the same in every worker, "
                         f"got {shown([own['chains'] for own in owns])}")
    return {**copy.deepcopy(shared), "pooled": {"rank": rank, "workers": workers, "batches": low + sum(ahead),
                                               "chains": {name: [own["chains"][name] for own in owns]
                                                          for name in names}}}


def pooled_resume(mix, state: dict) -> dict:
    """A pooled state (pooled_workers') as own_state gives a worker's: the saving rank's
    chains folded into each stream's base, as a loader state's on other ranks or workers
    are, and the pass starting where the fold says."""
    saved = SavedState(mix, *pooled_state(mix, state))
    return {"epoch": saved.epoch, "first": 0, "anchor": saved.folded(mix)}


def pooled_state(mix, state: dict) -> tuple[dict, dict]:
    """(a loader state, the pool) of a pooled state (pooled_workers'), for SavedState: the
    saving rank's pass at the batches it had handed out."""
    pool = state["pooled"]
    who = "MixStream.load_state_dict: the pooled"
    if not isinstance(pool, dict) or set(pool) != POOL_KEYS:
        raise ValueError(f"MixStream.load_state_dict: pooled must be a dict of {', '.join(sorted(POOL_KEYS))}, as "
                         f"readers.for_workers gives it, got {shown(pool)}")
    workers = bounded_int(pool["workers"], "workers", who, 1, MAX_WORKERS)
    batches = bounded_int(pool["batches"], "batches", who, 0, MOST)
    anchor = state.get("anchor")
    ours = isinstance(anchor, dict) and anchor.get("epoch") == state.get("epoch")
    skipped = bounded_int(anchor.get("skipped"), "skipped", "MixStream.load_state_dict: the anchor's", 0, MOST) \
        if ours else 0
    loader = {key: value for key, value in state.items() if key != "pooled"}
    loader.update(workers=workers, position={"workers": workers, "batches": skipped + batches,
                                             "batch_size": state.get("batch_size"),
                                             "drop_last": state.get("drop_last")})
    return loader, pool


def with_pooled_rows(chains: dict, pool: dict, world_size: int) -> dict:
    """The saved chains with the pooling rank's rows its workers' own counts. The other ranks'
    are worked out from the anchor, as the pooling rank's are: where those differ (its run
    resumed from workers' own states), only a one-rank run's chains are all known."""
    rank = bounded_int(pool["rank"], "rank", "MixStream.load_state_dict: the pooled", 0, world_size - 1)
    if list(pool["chains"]) != list(chains) or not all(
            isinstance(row, list) and len(row) == len(chains[name][rank]) and
            all(type(n) is int and 0 <= n <= MOST for n in row) for name, row in pool["chains"].items()):
        raise ValueError(f"MixStream.load_state_dict: the pooled chains must hold a count >= 0 per worker for each "
                         f"stream source ({', '.join(chains)}), got {shown(pool['chains'])}")
    if world_size > 1 and any(pool["chains"][name] != chains[name][rank] for name in chains):
        raise ValueError(f"Mix: this rank's workers' chains are not where its pass began says (its run was resumed "
                         f"from its workers' own states), so the other {world_size - 1} rank(s)' cannot be worked "
                         "out from one rank's state: resume with the ranks and workers that saved it, or run "
                         "through readers.make_loader's loader, whose state holds every rank's")
    return {name: [pool["chains"][name] if r == rank else row for r, row in enumerate(rows)]
            for name, rows in chains.items()}
