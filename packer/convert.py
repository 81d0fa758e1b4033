"""Converts a packed dataset to another format, byte for byte, through the pack machinery.

With max_side or baseline_420 (convert --max-side, --baseline-420) the records they name are re-encoded on the way
(packer.reencode), by the same worker processes; every other record keeps its bytes.

The records come from the packed dataset's Reader instead of the source folder (which is
never opened, and need not exist any more): worker processes read and check them (each record against its checksum),
and the parent feeds them in order to the target format's Writer, staged and published
atomically exactly as `pack` does, and stopped by Ctrl-C as `pack` is.
"""
from __future__ import annotations

import inspect
import os
import time

import numpy as np

from .check import MAX_PIXELS, packed_max_pixels
from .formats import FORMATS, ReaderCache, detect_format, format_named, open_reader, read_metadata
from .cores import available_cores
from .destination import destination_for
from .engine import RECORD_CHUNK, load_in_processes
from .interrupts import InterruptGuard
from . import checksum as record_checksums
from .formats._tables import spilled_array
from .writing import (Loaded, PackResult, loaded_under, now_utc, shuffle_seed_for, write_dataset, write_listings,
                      write_order)
from .records import Metadata
from .reencode import Reencode, combinable, combined, reencode_spec
from .scan import SplitListing
from .version import __version__


class RecordLoader:
    """load((split, index)) -> Loaded for one packed dataset; picklable, so each pool
    worker opens its own readers once."""

    def __init__(self, path: str, reencode: Reencode | None = None, max_pixels: int = MAX_PIXELS,
                 kind: str = record_checksums.DEFAULT):
        self.readers = ReaderCache(path)
        self.reencode, self.max_pixels = reencode, max_pixels
        self.kind = kind  # the output's record checksum kind

    def __call__(self, job: tuple[str, int]) -> Loaded:
        split, index = job
        data, _, _ = self.readers[split].read(index)  # raises CorruptDataError on a checksum mismatch
        if self.reencode is not None:
            return loaded_under(self.reencode, data, self.max_pixels, self.kind)
        return Loaded(data, record_checksums.record_checksum(data, self.kind), None)

    def close(self) -> None:
        self.readers.close()


class RecordJobs:
    """RecordLoader's jobs, (split, index), in write order, made as the engine asks for them:
    a sequence (len, index, slice), not a list of a million tuples."""

    def __init__(self, listings: dict[str, SplitListing], orders: dict[str, np.ndarray | None]):
        self.parts = [(split, orders[split]) for split in listings]
        self.starts = np.cumsum([0] + [len(listing) for listing in listings.values()])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        if not 0 <= k < len(self):
            raise IndexError(f"job {k} out of range for {len(self)} jobs")
        part = int(np.searchsorted(self.starts, k, side="right")) - 1
        split, order = self.parts[part]
        j = k - int(self.starts[part])
        return split, (j if order is None else order.item(j))


def converted_output(packed: str, src_fmt: str, fmt: str) -> str:
    """PACKED with its format's extension replaced by fmt's: data.lmdb -> data.h5."""
    base = os.path.abspath(packed).rstrip(os.sep)
    ext = FORMATS[src_fmt].extension
    if base.endswith(ext) and len(base) > len(ext):
        base = base[:-len(ext)]
    return base + format_named(fmt).extension


# Conversions recorded in full under params.converted_from, newest first, each holding the
# params of what it converted: every one nests two levels deeper, and metadata is refused
# past packer.records.MAX_NESTING. Older ones are only counted (EARLIER), so any number of
# chained converts keeps valid metadata.
KEPT_CONVERSIONS = 8
EARLIER = "earlier_conversions"


def kept_chain(params: dict, keep: int) -> dict:
    """params with at most keep conversions under its converted_from; the rest counted in
    the last one kept's params as EARLIER."""
    origin = params.get("converted_from")
    if not isinstance(origin, dict):
        return params
    if keep == 0:
        rest = {key: value for key, value in params.items() if key != "converted_from"}
        return {**rest, EARLIER: chain_length(origin)}
    inner = origin.get("params")
    if not isinstance(inner, dict):
        return params
    return {**params, "converted_from": {**origin, "params": kept_chain(inner, keep - 1)}}


def chain_length(origin) -> int:
    """The conversions recorded under origin, the counted ones included."""
    length = 0
    while isinstance(origin, dict):
        length += 1
        params = origin.get("params")
        if not isinstance(params, dict):
            break
        earlier = params.get(EARLIER)
        length += earlier if type(earlier) is int and earlier > 0 else 0
        origin = params.get("converted_from")
    return length


def convert(packed: str, fmt: str, out: str | None = None, *, force: bool = False, staging_dir: str | None = None,
            storage_options: dict | None = None, **kwargs) -> PackResult:
    """Write the packed dataset at `packed` as `fmt` at out, a path or a URL (s3://bucket/key:
    packed in a folder under staging_dir, then uploaded with storage_options; packer.destination).
    The other keyword arguments are convert_here's."""
    inspect.signature(convert_here).bind(packed, fmt, out, **kwargs)  # a misspelt keyword fails before any write
    destination = destination_for(out, lambda: converted_output(packed, detect_format(packed), fmt), force=force,
                                  staging_dir=staging_dir, storage_options=storage_options)
    return destination.write(fmt, [packed], lambda local, force: convert_here(packed, fmt, local, force=force,
                                                                              **kwargs))


def convert_here(packed: str, fmt: str, out: str | None = None, *, workers: int | None = None,
            force: bool = False, progress: bool | None = None, options: dict | None = None,
            shuffle: bool | None = None, shuffle_seed: int = 0, max_side: int | None = None,
            quality: int | None = None, baseline_420: bool = False,
            checksum: str = record_checksums.DEFAULT) -> PackResult:
    """Write the packed dataset at `packed` as `fmt` at out, keeping every record's bytes (out
    as given: convert() checks it first through its destination, packer.destination).

    shuffle and shuffle_seed as for pack(): wds output is shuffled by default. max_side and
    quality as for pack(): the records over max_side are re-encoded, the others kept;
    baseline_420 as for pack(), except after a pack with it and a larger max_side (refused:
    packer.reencode.combinable).
    checksum as for pack(): the output's record checksum kind, whatever the input's.
    """
    record_checksums.check_kind(checksum)
    seed = shuffle_seed_for(fmt, shuffle, shuffle_seed)
    reencode = reencode_spec(max_side, quality, baseline_420)
    options = format_named(fmt).writer_options(options)
    start = time.perf_counter()
    packed = os.path.abspath(packed)
    src_fmt = detect_format(packed)
    src_meta = read_metadata(packed)
    combinable(src_meta.reencode, reencode, packed)
    out = os.path.abspath(out or converted_output(packed, src_fmt, fmt))
    workers = workers or available_cores()
    listings = {}
    for split, info in src_meta.splits.items():
        reader = open_reader(packed, split)
        try:
            listings[split] = SplitListing(reader.paths, reader.labels, info.labeled)
        finally:
            reader.close()
    orders = {split: write_order(len(listing), split, seed) for split, listing in listings.items()}
    orders = {split: None if order is None else spilled_array(order, os.path.dirname(out))
              for split, order in orders.items()}
    jobs = RecordJobs(listings, orders)
    params = {"format": fmt, "workers": workers, **options, "shuffle_seed": seed,
              "converted_from": {"path": packed, "format": src_fmt, "created": src_meta.created,
                                 "params": kept_chain(src_meta.params, KEPT_CONVERSIONS - 1)}}

    advice: list[str] = []  # the writer's (wds: too few shards for this machine)
    with InterruptGuard(out) as guard:
        def fill(writer) -> Metadata:
            load = RecordLoader(packed, reencode, packed_max_pixels(src_meta.params), checksum)
            try:
                loaded = load_in_processes(jobs, load, workers, chunk=RECORD_CHUNK)
                written = write_listings(writer, listings, len(src_meta.classes), loaded, "fail", progress, orders,
                                         guard)
            finally:
                load.close()
            advice.extend(written.warnings)
            return Metadata(format=fmt, classes=src_meta.classes, splits=written.splits, source=src_meta.source,
                            created=now_utc(), packer_version=__version__, params=params,
                            skipped=src_meta.skipped + written.skipped,
                            reencode=combined(src_meta.reencode, reencode, written.reencoded),
                            checksum=checksum)

        meta = write_dataset(fmt, out, force, options, fill, checksum)
    return PackResult(out, meta, time.perf_counter() - start, advice)
