"""A loader's resume state about its order: the sampler's or stream's part of EpochLoader's
state_dict(), taken at the batches handed out, and the checks that a loaded part agrees
with the loader's own epoch and position. The positions themselves, and how any number of
ranks deal the rest of an epoch, are readers.elastic's; what fixes each order, its
sampler's (readers.sampler, readers.mix)."""
from __future__ import annotations

from ._state_limits import shown
from .elastic import pass_length


def sampler_state(sampler, epoch: int, pass_batches: int | None, batch_size: int) -> dict:
    """The sampler's state at the loader's position: the indexes of the batches handed out
    in this pass (the workers draw ahead of them), or the start of an epoch not begun."""
    state = {**sampler.state_dict(), "epoch": epoch}
    if pass_batches is None:
        return {**state, "position": 0, **({"start": 0} if "start" in state else {})}
    return {**state, "position": min(pass_batches * batch_size, len(sampler))}


def sampler_position(sampler, part, batches: int, batch_size: int):
    """The position a sampler state saved after `batches` batches of its epoch must hold:
    the batches' indexes, for a pass that began the epoch (on the world size that saved
    it); a resumed pass's own count is not the loader's, so its part is taken as it is."""
    world_size = part.get("world_size") if isinstance(part, dict) else None
    if (not hasattr(sampler, "pass_length") or part.get("start", 0) != 0 or isinstance(world_size, bool)
            or not isinstance(world_size, int) or world_size < 1):
        return part.get("position") if isinstance(part, dict) else None
    count = sampler.count_of(part) if hasattr(sampler, "count_of") else sampler.count  # a reweighted mix's may differ
    return min(batches * batch_size, pass_length(count, 0, world_size, sampler.drop_last))


def stream_batches(part, batches: int):
    """The batch count a stream's state saved after `batches` batches of its epoch must
    hold: the loader's, unless the pass followed a resume on other ranks or workers."""
    position = part.get("position") if isinstance(part, dict) else None
    if isinstance(position, dict) and "history" in position:
        return position.get("batches", position.get("samples"))
    return batches


def check_part(part, epoch: int, position: int, name: str) -> None:
    """Refuse a sampler's or dataset's state that disagrees with the loader's epoch and
    position (a state put together by hand, or from two checkpoints)."""
    if not isinstance(part, dict):
        raise ValueError(f"EpochLoader.load_state_dict: the {name} state must be a dict, got {type(part).__name__}")
    saved = part.get("position")
    if name == "dataset":  # WDSDataset's: None at an epoch's start, else the loader's batch count
        saved = 0 if saved is None else saved.get("batches") if isinstance(saved, dict) else saved
    if part.get("epoch") != epoch or saved != position:
        raise ValueError(f"EpochLoader.load_state_dict: the {name} state (epoch {shown(part.get('epoch'))}, position "
                         f"{shown(saved)}) disagrees with the loader's (epoch {epoch}, position {position}); save and "
                         "load whole states from state_dict()")
