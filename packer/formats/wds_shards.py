"""The WebDataset format's public reading API for streams, for a reader that knows no byte
layout (readers.WDSDataset): a packer folder's shards and their sample counts from its index
(indexed_split), and the members of any shard, packer's or another tool's (iter_samples,
count_samples, image_suffix). A packer shard's images are also read by its index
(read_stored, read_stored_runs, where packer.formats.wds.Reader.as_indexed says the shard allows
it)."""
from __future__ import annotations

import os
from typing import Iterator, NamedTuple

import numpy as np

from ..checksum import MASK
from ..errors import CorruptDataError
from ..records import choose_split
from . import _io
from ._tar import Sample, count_samples, image_suffix, iter_samples  # noqa: F401 (the members of a shard)
from ._wds_index import open_index
from .wds import stored_part


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


def read_stored(reader, shard: int, start: int = 0, stop: int | None = None
                ) -> Iterator[tuple[int, bytes | CorruptDataError, int]]:
    """(index, image bytes, label) of each sample the shard holds from its start-th to before
    its stop-th (None: to its end), in order,
    for a packer.formats.wds.Reader: one pread each and no tar header parsed (advise the
    reader "sequential" first, for the kernel to read ahead), the records read from the
    mapped records.bin (Reader.stored_in checks the shard's on first use). A sample failing
    its checksum comes as (index, the error, label) and the stream goes on; a shard cut
    short raises at the first sample past its end. The other shards' descriptors are closed:
    one is open at a time, however many shards a stream reads. A run's stop keeps a
    one-sample run (what a resumed stream's shuffle buffer held) to one record's ints."""
    reader.close_other_shards(shard)
    yield from read_indexes(reader, shard, stored_part(reader, shard, start, stop))


def read_stored_runs(reader, shard: int, starts: np.ndarray, stops: np.ndarray
                     ) -> Iterator[tuple[int, bytes | CorruptDataError, int]]:
    """read_stored() of the runs [starts, stops) of the shard's samples (sorted, disjoint),
    one after another, in one pass: a resumed stream reads hundreds of one-sample runs of a
    shard (what its shuffle buffer held), each of which would be a read_stored() of its own.
    A run past the shard's end is cut at it, as read_stored() cuts one."""
    reader.close_other_shards(shard)
    counts = stops - starts
    positions = np.arange(counts.sum(), dtype=np.int64) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
    if not len(positions):
        return
    low = int(positions[0])
    part = stored_part(reader, shard, low, int(positions[-1]) + 1)
    yield from read_indexes(reader, shard, part[positions[positions - low < len(part)] - low])


def read_indexes(reader, shard: int, indexes: np.ndarray) -> Iterator[tuple[int, bytes | CorruptDataError, int]]:
    """read_stored()'s samples: those of `indexes`, which the shard holds, in their order."""
    fd, records = reader.shard_fd(shard), reader.record_blocks()[0]
    for index in chunked_ints(indexes):
        _, crc, offset, size, label = records[index].tolist()
        data = _io.pread(fd, size, offset)
        if len(data) != size:
            raise CorruptDataError(f"{os.path.join(reader.path, reader.shards[shard])}: truncated at byte "
                                   f"{offset + len(data)}: the file ends inside sample {reader.split}/{index} "
                                   f"({reader.path_of(index)}), which needs bytes {offset}-{offset + size} "
                                   "(re-pack, or restore the shard from a copy)", reader.path)
        if reader.check_crc and reader.record_digest(data) & MASK != crc:
            try:
                reader.checksum_mismatch(index)
            except CorruptDataError as exc:
                yield index, exc, label
            continue
        yield index, data, label


def chunked_ints(array: np.ndarray, chunk: int = 4096) -> Iterator[int]:
    """array's items as Python ints, a chunk made at a time (not one list of a shard's)."""
    for begin in range(0, len(array), chunk):
        yield from array[begin:begin + chunk].tolist()
