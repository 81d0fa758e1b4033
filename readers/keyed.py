"""Augmentation randomness keyed to the sample: what a transform draws depends on (seed, epoch,
the sample's index, the transform's place), never on the process or worker that runs it.

packer's samplers (ShuffleSampler, BlockShuffleSampler) hand out each index as a KeyedIndex:
an int that also carries the run's prefix, (seed, epoch). Whatever loader draws from them
(make_loader's, torchdata's StatefulDataLoader, a plain DataLoader) carries it through the
index queue to the worker that reads the sample, so the epoch reaches a persistent worker
without any call into it, and the resume state holds nothing new. The dataset calls its
transform under the sample's key, (*prefix, index) (call_keyed); a mixture of datasets can
extend the prefix with its source's name before it hands the index on (KeyedIndex.within).

Under a key, each call of sample_generator() (or sample_seed()) gets its own stream, numbered
in the order the calls come: the first transform of a pipeline that asks gets stream 0, the
next stream 1, so one transform's draws do not shift another's. Outside a key (ds[i] with a
plain int, a sampler built with keyed=False) both return None and transforms draw from
torch's global generator, which each DataLoader worker seeds for itself, as before.

Streams are seeded with 63 bits of BLAKE2b over the key's text: the same on every machine,
Python version and process, unlike hash().
"""
from __future__ import annotations

import functools
import hashlib
import threading

import torch

KEYED_CLASSES = 256  # prefixes whose KeyedIndex classes are kept: a run's live passes and sources
_local = threading.local()  # .sample: [key, streams handed out] while a keyed call runs


class KeyedIndex(int):
    """A sample's index that carries its run's key prefix, (seed, epoch) from packer's samplers.

    It is the index wherever an int is taken; `prefix` rides along through pickling (the
    DataLoader's index queue) to the process that reads the sample.
    """

    def __new__(cls, index: int, prefix: tuple):
        self = super().__new__(cls, index)
        self.prefix = prefix
        return self

    def __reduce__(self):
        return KeyedIndex, (int(self), self.prefix)

    def within(self, source, index: int) -> "KeyedIndex":
        """The index `index` of a mixture's source `source` (a name or number), keyed by this
        run and that source: what a mixture hands its source dataset in place of self."""
        return KeyedIndex(index, (*self.prefix, source))

    @property
    def key(self) -> tuple:
        return (*self.prefix, int(self))


@functools.lru_cache(maxsize=KEYED_CLASSES)
def keyed_by(prefix: tuple) -> type:
    """A KeyedIndex class whose indexes all carry `prefix`: each index then costs int's own
    constructor, not a Python __new__ (a sampler hands out 10^5 a second). Made once a
    prefix and kept (a class costs ~20 us to make: a mixture asks one a batch's source)."""
    return type("KeyedIndex", (KeyedIndex,), {"prefix": prefix, "__new__": int.__new__})


def key_of(index) -> tuple | None:
    """The sample key an index carries, or None for a plain index."""
    return index.key if isinstance(index, KeyedIndex) else None


def call_keyed(key: tuple | None, function, *args):
    """function(*args) with sample_generator() keyed to `key` (None: unkeyed, as outside)."""
    if key is None:
        return function(*args)
    outer = getattr(_local, "sample", None)
    _local.sample = [key, 0]
    try:
        return function(*args)
    finally:
        _local.sample = outer


def sample_seed() -> int | None:
    """The seed of the next stream of the sample being transformed, or None outside a keyed
    sample. Each call takes the next stream (see the module's docstring)."""
    state = getattr(_local, "sample", None)
    if state is None:
        return None
    key, place = state
    state[1] = place + 1
    return stream_seed(key, place)


def sample_generator() -> torch.Generator | None:
    """A new CPU torch.Generator for the next stream of the sample being transformed, or None
    outside a keyed sample (then draw from torch's global generator: pass generator=None)."""
    seed = sample_seed()
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def stream_seed(key: tuple, place: int) -> int:
    """63 bits derived from the sample's key and the stream's place; ints and strings only."""
    text = "\x1f".join(_part(part) for part in (*key, place))
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, person=b"packer-aug").digest()
    return int.from_bytes(digest, "little") >> 1


def _part(part) -> str:
    if isinstance(part, str):
        return "s" + part
    if isinstance(part, bool) or not hasattr(part, "__index__"):
        raise TypeError(f"a sample key holds ints and strings, not {part!r} ({type(part).__name__})")
    return "i" + str(part.__index__())


class KeyedTransform:
    """Runs a transform that draws from torch's global generator (a torchvision v2 transform,
    say) with that generator seeded from the sample's key, and restores it after: its random
    parameters then come from the key. Outside a keyed sample it runs as it is. CPU draws
    only: the CUDA generators are left alone."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, *args):
        seed = sample_seed()
        if seed is None:
            return self.transform(*args)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # not torch.manual_seed, which seeds CUDA too
            return self.transform(*args)

    def __repr__(self) -> str:
        return f"KeyedTransform({self.transform!r})"
