"""An epoch's global order dealt to any number of ranks: what makes a resume elastic.

A sampler's order is one sequence of the dataset's N indexes fixed by (seed, epoch)
alone: the global order. A pass on W ranks that starts C samples into it deals the rest
by position, as DistributedSampler deals a permutation: rank r takes rest[r::W]. So at
step s the ranks together consume the next W x batch_size samples of the global order
whatever W is, and once every rank has consumed p indexes, the samples consumed are
exactly the first C + p * W of it. That one count resumes the epoch on any number of
ranks: the rest is the global order from there, dealt again. It holds however a step's W
positions are shared among the ranks: readers.mix deals them by source instead.

Equal shares: without drop_last the rest is padded to a multiple of W with indexes from
the start of the global order (at most W - 1 repeats, as DistributedSampler pads); with
drop_last its last (rest mod W) indexes are left out.

A rank's share is dealt a chunk of positions at a time (rank_position_chunks), never as
one array or list: a share of 10^9 records costs what one chunk does.
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ._state_limits import MAX_WORLD_SIZE, bounded_int, shown

CHUNK = 4096  # positions dealt at a time: one vectorised step of the order, a few tens of KB


def pass_length(count: int, start: int, world_size: int, drop_last: bool) -> int:
    """Indexes each of `world_size` ranks takes of the rest of a global order of `count`
    that starts `start` samples in."""
    rest = max(0, count - start)
    return rest // world_size if drop_last else math.ceil(rest / world_size)


def rank_positions(count: int, start: int, rank: int, world_size: int, drop_last: bool,
                   first: int = 0, stop: int | None = None) -> np.ndarray:
    """The positions in the global order that `rank` reads, in order, in a pass from `start`:
    its share's slots [first, stop) (stop None: to the share's end)."""
    share = pass_length(count, start, world_size, drop_last)
    stop = share if stop is None else min(stop, share)
    slots = rank + world_size * np.arange(min(first, stop), stop, dtype=np.int64)  # places in the rest, padded
    rest = max(0, count - start)
    # A place past the rest's end is padding: the global order again from its start.
    return np.where(slots < rest, start + slots, (slots - rest) % max(count, 1))


def rank_position_chunks(count: int, start: int, rank: int, world_size: int, drop_last: bool,
                         chunk: int = CHUNK) -> Iterator[np.ndarray]:
    """rank_positions' share, `chunk` positions at a time, each chunk made as it is asked for."""
    share = pass_length(count, start, world_size, drop_last)
    for first in range(0, share, chunk):
        yield rank_positions(count, start, rank, world_size, drop_last, first, first + chunk)


def consumed(count: int, start: int, position: int, world_size: int) -> int:
    """Samples of the global order consumed once every rank of a pass from `start` on
    `world_size` ranks has consumed `position` indexes (padding counts nothing)."""
    return min(count, start + position * world_size)


def ended(count: int, start: int, position: int, world_size: int, drop_last: bool) -> bool:
    """Whether a pass from `start` on `world_size` ranks was over once every rank had consumed
    `position` indexes: its epoch was wholly consumed, as the ranks that saved it deal it."""
    return count > 0 and position == pass_length(count, start, world_size, drop_last)


def elastic_fields(state: dict, kind: str, count: int, drop_last: bool) -> tuple[int, int, int]:
    """(world_size, start, position) of a sampler state, checked: a position within that
    pass, a start within the epoch."""
    who = f"{kind}.load_state_dict"
    world_size = bounded_int(state.get("world_size"), "world_size", who, 1, MAX_WORLD_SIZE)
    start = bounded_int(state.get("start", 0), "start", who, 0, count)  # states before elastic resume began at 0
    most = pass_length(count, start, world_size, drop_last)
    position = state.get("position")
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= most:
        raise ValueError(f"{who}: position must be an int >= 0 <= {most}, got {shown(position)}")
    return world_size, start, position
