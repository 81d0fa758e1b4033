"""The WebDataset format's public reading API for streams, for a reader that knows no byte
layout (readers.WDSDataset): a packer folder's shards and their sample counts from its index
(indexed_split), and the members of any shard, packer's or another tool's (iter_samples,
count_samples, image_suffix). A packer shard's images are also read by its index, through
packer.formats.wds.Reader (as_indexed, read_stored)."""
from __future__ import annotations

from typing import NamedTuple

from ..records import choose_split
from ._tar import Sample, count_samples, image_suffix, iter_samples  # noqa: F401 (the members of a shard)
from ._wds_index import open_index


class IndexedSplit(NamedTuple):
    """One split of a packer WebDataset folder, as its checked index.json lists it."""

    split: str
    shards: list[str]  # the shards' file names, relative to the folder, in stored order
    counts: list[int]  # each shard's sample count
    classes: list[str]
    created: str  # when the pack was made ("" in an index without the field)
    contents: dict  # the index's entry for the split: every shard's name, count, bytes and SHA-256; the tables'


def indexed_split(path: str, split: str | None = None, remote=None) -> IndexedSplit:
    """The split (None: the only one there is) of the packer WebDataset folder at path
    (a URL with remote, a packer.remote Remote), from its index.json, checked."""
    index, _ = open_index(path, remote)
    split = choose_split(list(index["wds"]["splits"]), split, path)
    entry = index["wds"]["splits"][split]
    return IndexedSplit(split, [shard["name"] for shard in entry["shards"]],
                        [shard["count"] for shard in entry["shards"]], list(index["classes"]),
                        index.get("created", ""), entry)
