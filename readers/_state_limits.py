"""What a resume state may make readers allocate, and the checks that hold it there.

A state comes from a checkpoint file, so every number in it is untrusted: a world size
of 10^9 would have the stream replay deal to 10^9 ranks, a worker count of 10^12 build a
list that long. Loading a state costs O(the data's own shape): the samples and shards
of the dataset, and at most MAX_WORLD_SIZE ranks x MAX_WORKERS workers per pass of the
epoch, at most MAX_HISTORY passes. A number past its bound, a structure nested deeper
than MAX_DEPTH or larger than MAX_ITEMS, is a ValueError naming the field, raised before
anything is built from it (docs/resume.md, "What a state may cost").
"""
from __future__ import annotations

import reprlib

MAX_WORLD_SIZE = 1 << 16  # ranks a saved pass may name
MAX_WORKERS = 1 << 10  # DataLoader workers per rank a saved pass may name
MAX_EPOCH = (1 << 32) - 1  # an epoch number (seeds are seed + epoch: they stay 64-bit)
MAX_HISTORY = 16  # passes of one epoch on other ranks or workers before the one saved
MAX_DEPTH = 24  # lists and dicts nested in a state (a StatefulDataLoader's nests 8)
MAX_ITEMS = 1 << 20  # list items and dict entries in a whole state
CONTAINERS = (dict, list, tuple)

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxdict, _SHOWN.maxlist, _SHOWN.maxstring, _SHOWN.maxother = 3, 8, 8, 240, 60
_SHOWN.maxlong = 40


def shown(value) -> str:
    """A value of a state, as an error message quotes it: a few hundred characters at most,
    however large or deep it is."""
    return _SHOWN.repr(value)


def check_shape(state, who: str) -> None:
    """Refuse a state nested deeper than MAX_DEPTH or holding more than MAX_ITEMS entries,
    walked without recursion, before anything copies, compares or prints it (each of which
    recurses)."""
    level, depth, items = ([state] if isinstance(state, CONTAINERS) else []), 0, 0
    while level:  # one level of nesting at a time: no object made per entry (a state may hold a million)
        depth += 1
        if depth > MAX_DEPTH:
            raise ValueError(f"{who}: the state nests lists or dicts over {MAX_DEPTH} deep, and no state packer or "
                             "torchdata saves does: it is damaged or was not saved by state_dict()")
        items += sum(map(len, level))
        if items > MAX_ITEMS:
            raise ValueError(f"{who}: the state holds over {MAX_ITEMS} list items and dict entries, more than any "
                             "state packer saves: it is damaged or was not saved by state_dict()")
        level = [child for value in level for child in (value.values() if isinstance(value, dict) else value)
                 if isinstance(child, CONTAINERS)]


def bounded_int(value, name: str, who: str, least: int = 0, most: int | None = None) -> int:
    """value as an int in [least, most], or a ValueError naming the field and the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        bound = "" if most is None else f" (and at most {most})"
        raise ValueError(f"{who}: {name} must be an int >= {least}, got {shown(value)}{bound}")
    return value
