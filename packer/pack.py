"""Packs a source folder into one format: parallel read + check, a single streaming writer.

Reader threads (processes for the decoding --check full) read and check files; the
parent receives them in write order and hands them to the format's Writer. The number
of files in flight is bounded, so memory stays flat however large the dataset is, and
nothing reaches OUT until the writer has finished (packer.output.staged).

The readers are packer.engine's; Ctrl-C stops a pack within moments and leaves nothing
behind (packer.interrupts). pack() builds the metadata once, from what the write loop
returns (Written): the source's classes and skipped folders, the splits and skipped files.
The write loop, the write order and the Writer protocol are packer.writing's, which
convert and merge share. One part of a source (part=) is packer.cut's slice of it; all
the parts on an Executor are packer.parts', above this module.
"""
from __future__ import annotations

import functools
import os
import time

import numpy as np

from .check import CHECKS, MAX_PIXELS, problem
from .cores import available_cores
from .cut import cut_source, part_spec
from .engine import load_in_processes, load_in_threads
from .errors import BadImageError, PackError
from .formats import default_output, format_named
from .formats._tables import spilled_array
from .interrupts import InterruptGuard
from . import checksum as record_checksums
from .records import Metadata
from .reencode import Reencode, reencode_spec
from .scan import ON_ERROR, Source, SplitListing, scan_source
from .source_io import read_regular_file
from .version import __version__
from .writing import (RELEASE_EVERY, Loaded, PackResult, Written, loaded_under, now_utc, release_listing,
                      shuffle_seed_for, write_dataset, write_listings, write_order)


def load_file(job: str | Loaded, level: str, max_pixels: int = MAX_PIXELS,
              reencode: Reencode | None = None, kind: str = record_checksums.LEGACY) -> Loaded:
    """Read and check one file; errors become a reason, so the parent decides the policy.

    job is the file's path, or a Loaded already decided without opening it (a refused file).
    reencode: re-encode the file as packer.reencode says (over max_side, or not in the form asked for). kind: the
    record checksum kind to compute (packer.checksum).
    """
    if isinstance(job, Loaded):
        return job
    try:
        data = read_regular_file(job)
    except OSError as exc:
        return Loaded(None, 0, f"cannot read file ({exc.strerror or exc})")
    except BadImageError as exc:  # not a regular file, or changed while being read
        return Loaded(None, 0, exc.reason)
    reason = problem(data, level, max_pixels)
    if reason is not None:
        return Loaded(None, 0, reason)
    if reencode is not None:
        return loaded_under(reencode, data, max_pixels, kind)
    return Loaded(data, record_checksums.record_checksum(data, kind), None)


def pack(src: str, fmt: str = "lmdb", out: str | None = None, *, workers: int | None = None,
         on_error: str = "fail", check: str = "header", force: bool = False,
         progress: bool | None = None, options: dict | None = None,
         shuffle: bool | None = None, shuffle_seed: int = 0, max_pixels: int = MAX_PIXELS,
         labels: str | os.PathLike | None = None, labels_index_base: int | None = None,
         max_side: int | None = None, quality: int | None = None, baseline_420: bool = False,
         part=None, checksum: str = record_checksums.DEFAULT) -> PackResult:
    """Pack the ImageFolder tree at src into `fmt` at out (default: src + the format's extension),
    as given: packer.pack (packer.api) checks out first, through packer.destination.

    shuffle writes each split in a seeded permutation of ImageFolder order (shuffle_seed);
    None means the format's default (on for wds, off for lmdb and hdf5). The header and
    full checks refuse an image whose header claims more than max_pixels pixels
    (packer.check.MAX_PIXELS). labels, a label file, labels the flat (unlabeled) splits
    (packer.labels: shapes, and labels_index_base for a list of class indexes); its name
    and SHA-256 go into the metadata params. max_side re-encodes, as JPEGs at quality, the
    images whose upright long side is over it (packer.reencode), and baseline_420 those
    not already baseline 4:2:0 (or grayscale) JPEGs (packer.jpeg_form); every other image
    is stored byte for byte.

    Packing in parts (packer.cut, docs/parts.md): part="I/N" (or (I, N)) packs part I,
    counted from 0, of N, a dataset of its own that `packer merge` joins with the others
    (its default OUT: SRC.part-0000I-of-0000N + the format's extension). All N parts at
    once, on an Executor, are packer.pack (packer.api), which takes this function's
    arguments.

    checksum: the kind of every record's checksum (packer.checksum): "xxh3", the default
    and the cheapest to check on each read, or "crc32", for other tools that check CRC-32.
    """
    seed, reencode, options = pack_settings(fmt, on_error=on_error, check=check, options=options, shuffle=shuffle,
                                            shuffle_seed=shuffle_seed, max_pixels=max_pixels, max_side=max_side,
                                            quality=quality, baseline_420=baseline_420, checksum=checksum)
    spec = None if part is None else part_spec(part)
    start = time.perf_counter()
    out = os.path.abspath(out or pack_output(src, fmt, spec))
    workers = workers or available_cores()
    with InterruptGuard(out) as guard:
        # The source's paths wait in an unlinked file beside OUT, mapped, not in memory.
        source = scan_source(src, on_error, labels, labels_index_base, spill_dir=os.path.dirname(out))
        cut = None
        if spec is not None:
            source, cut = cut_source(source, spec)
        params = {"format": fmt, "check": check, "on_error": on_error, "workers": workers, "max_pixels": max_pixels,
                  **options, "shuffle_seed": seed, **label_params(source, labels_index_base)}

        advice: list[str] = []  # the writer's (wds: too few shards for this machine)

        def fill(writer) -> Metadata:
            written = write_source(writer, source, check, on_error, workers, progress, seed, max_pixels, guard,
                                   reencode, checksum, spill_dir=os.path.dirname(out))
            advice.extend(written.warnings)
            return Metadata(format=fmt, classes=source.classes, splits=written.splits, source=source.root,
                            created=now_utc(), packer_version=__version__, params=params,
                            skipped=source.skipped + written.skipped,
                            parts=None if cut is None else cut.facts(source.splits, written.skipped),
                            reencode=None if reencode is None else reencode.record(written.reencoded),
                            checksum=checksum)

        meta = write_dataset(fmt, out, force, options, fill, checksum)
    return PackResult(out, meta, time.perf_counter() - start, source.warnings + advice)


def pack_output(src: str, fmt: str, part=None) -> str:
    """pack()'s default OUT: src + the format's extension, or for a part its own name beside src."""
    return part_spec(part).output(src, fmt) if part is not None else default_output(src, fmt)


def pack_settings(fmt: str, *, on_error: str = "fail", check: str = "header", options: dict | None = None,
                  shuffle: bool | None = None, shuffle_seed: int = 0, max_pixels: int = MAX_PIXELS,
                  max_side: int | None = None, quality: int | None = None, baseline_420: bool = False,
                  checksum: str = record_checksums.DEFAULT, **_) -> tuple[int | None, Reencode | None, dict]:
    """pack()'s arguments checked before anything is written, each refused with a PackError: the
    shuffle seed, the re-encoding and the writer options (checked) they give. Its other arguments
    (**_: src's labels, workers...) are checked where they are used."""
    record_checksums.check_kind(checksum)
    seed = shuffle_seed_for(fmt, shuffle, shuffle_seed)
    reencode = reencode_spec(max_side, quality, baseline_420)
    options = format_named(fmt).writer_options(options)
    if on_error not in ON_ERROR:
        raise PackError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
    if check not in CHECKS:
        raise PackError(f"check must be one of {', '.join(CHECKS)}, not {check!r}")
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise PackError(f"max_pixels must be a positive integer (default {MAX_PIXELS}), not {max_pixels!r}")
    return seed, reencode, options


def label_params(source: Source, index_base: int | None) -> dict:
    """The metadata params that record the label file applied, if any."""
    if source.labels is None:
        return {}
    found = source.labels.params()
    if source.labels.by_position is not None:
        found["index_base"] = index_base
    return {"labels": found}


def decodes_images(check: str, reencoding: bool) -> bool:
    """Whether a pack decodes its images (--check full, --max-side, --baseline-420): CPU-bound work, done in
    worker processes. Reading and the header check are I/O-bound: threads, which skip the
    pipe that processes send every file through."""
    return check == "full" or reencoding


def write_source(writer, source: Source, check: str, on_error: str, workers: int,
                 progress: bool | None, seed: int | None, max_pixels: int = MAX_PIXELS,
                 guard: InterruptGuard | None = None, reencode: Reencode | None = None,
                 kind: str = record_checksums.LEGACY, spill_dir: str | None = None) -> Written:
    """Stream every split of the source folder through writer, with checksums of kind.
    spill_dir: where the write orders wait, in unlinked files, mapped
    (packer.formats._tables.spilled_array)."""
    listings = {name: source.splits[name] for name in sorted(source.splits)}
    orders = {name: write_order(len(listing), name, seed) for name, listing in listings.items()}
    orders = {name: None if order is None else spilled_array(order, spill_dir) for name, order in orders.items()}
    jobs = source_jobs(source.root, listings, orders)
    load = functools.partial(load_file, level=check, max_pixels=max_pixels, reencode=reencode, kind=kind)
    load_in = load_in_processes if decodes_images(check, reencode is not None) else load_in_threads
    loaded = load_in(jobs, load, workers)
    return write_listings(writer, listings, len(source.classes), loaded, on_error, progress, orders, guard)


class SourceJobs:
    """load_file's jobs in write order, made as the engine asks for them: each file's path,
    or its refusal when it must not be opened. A sequence (len, index, slice), not a list
    of a million paths."""

    def __init__(self, root: str, listings: dict[str, SplitListing], orders: dict[str, np.ndarray | None]):
        self.root = root
        self.parts = [(listing, orders[name]) for name, listing in listings.items()]
        self.starts = np.cumsum([0] + [len(listing) for listing, _ in self.parts])
        self.looked_up = 0  # lookups since the listing's pages were last dropped (threads: roughly)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        part = int(np.searchsorted(self.starts, k, side="right")) - 1
        listing, order = self.parts[part]
        # The read-ahead looks up to WINDOW_FILES paths ahead of the writer, in shuffled order:
        # each lookup faults in pages around its path, so between the writer's drops (a shard
        # being synced) they could make the whole mapped path table resident. Dropped here too.
        self.looked_up += 1
        if self.looked_up >= RELEASE_EVERY:
            self.looked_up = 0
            release_listing(listing, order)
        j = k - int(self.starts[part])
        i = j if order is None else order.item(j)
        refused = listing.refused.get(i)
        return os.path.join(self.root, listing.paths[i]) if refused is None else Loaded(None, 0, refused)


def source_jobs(root: str, listings: dict[str, SplitListing], orders: dict[str, np.ndarray | None]) -> SourceJobs:
    """load_file's jobs in write order (SourceJobs)."""
    return SourceJobs(root, listings, orders)


