"""Merges the parts of one source (packer.parts) into the dataset a single pack of it gives.

The merge copies: worker processes read and checksum-check the parts' records, and the parent
hands them to the format's Writer in the single pack's write order (ImageFolder order, or
its seeded permutation per split), through pack's own write path, staged and published
atomically and stopped by Ctrl-C as `pack` is. The result has the indexes, labels,
classes, splits, left-out files and, where the container is deterministic (wds shards and
tables), the very bytes of a single pack; only its metadata differs: when it was made,
and "parts", which names each part it was merged from.

Parts are refused, each by name, when one is not a part, is half-written (a staging name
of packer.output: OUT.partial-*, OUT.complete-*), is given twice, is of another source,
format, options or record checksum kind, or of another count of parts, when two hold the same slice, or when
one is missing. Beyond the fingerprint (a hash of the source, which an edit can copy), every
part must declare its source as the others do (declared: file counts, splits, classes),
and hold what it declares (its tables' lengths and class counts).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from .cores import available_cores
from .destination import destination_for
from .errors import FormatError, PackError, shown
from .formats import FORMATS, ReaderCache, open_reader, read_metadata
from .engine import RECORD_CHUNK, load_in_processes
from .interrupts import InterruptGuard
from . import checksum as record_checksums
from .records import UNLABELED, Metadata, PathTable, path_offsets
from .scan import SplitListing
from .staging import COMPLETE, LEGACY, OWNED, PARTIAL
from .version import __version__
from .writing import Loaded, PackResult, now_utc, split_order, write_dataset, write_listings, write_order

# params that may differ between the parts of one pack: how each machine ran it.
PER_MACHINE_PARAMS = frozenset({"workers"})


@dataclass
class Part:
    """One part given to merge: where it is, and its metadata (whose "parts" says which)."""

    path: str
    meta: Metadata
    given: str  # the path as the user spelled it (two spellings of one part differ here)

    @property
    def facts(self) -> dict:
        return self.meta.parts

    @property
    def index(self) -> int:
        return self.facts["index"]

    @property
    def count(self) -> int:
        return self.facts["count"]

    @property
    def options(self) -> dict:
        return {k: v for k, v in self.meta.params.items() if k not in PER_MACHINE_PARAMS}

    @property
    def written_skipped(self) -> list[dict]:
        """The metadata's entries for files left out while writing (the last ones; folders
        the scan left out come first)."""
        n = sum(len(entry["skipped_at"]) for entry in self.facts["splits"].values())
        return self.meta.skipped[len(self.meta.skipped) - n:] if n else []

    @property
    def scan_skipped(self) -> list[dict]:
        return self.meta.skipped[:len(self.meta.skipped) - len(self.written_skipped)]


def staging_name(path: str) -> str | None:
    """The stage (partial, complete) if path's name is a staging name of packer.output."""
    name = os.path.basename(path.rstrip(os.sep))
    for pattern in (OWNED, LEGACY):
        for match in pattern.finditer(name):
            if match["stage"] in (PARTIAL, COMPLETE) and match.end() == len(name):
                return match["stage"]
    return None


def read_part(path: str) -> Part:
    """The part at path, refused if half-written or not a part."""
    given = os.fspath(path)
    path = os.path.abspath(given)
    stage = staging_name(path)
    if stage is not None:
        raise PackError(f"{path}: a half-written part (its name is a {stage} staging name: the pack writing it "
                        "is still running, or was killed); wait for that pack, or if none is running remove it "
                        f"(rm -rf '{path}') and pack that part again", path)
    if not os.path.exists(path):
        raise PackError(f"{path}: no such part (pack it with `packer pack SRC --part I/N -o {path}`)", path)
    meta = read_metadata(path)
    if meta.parts is None or "index" not in meta.parts:
        what = "a merge of parts" if meta.parts is not None else "a dataset packed in one piece"
        raise FormatError(f"{path}: not a part but {what}; merge takes the parts written by "
                          "`packer pack SRC --part I/N`", path)
    part = Part(path, meta, given)
    for name, entry in meta.parts["splits"].items():
        listed = sum(1 for skipped in part.written_skipped if skipped.get("split") == name)
        if listed != len(entry["skipped_at"]):
            raise FormatError(f"{path}: its metadata places {len(entry['skipped_at'])} left-out files in split "
                              f"{name} but lists {listed}; the part is damaged, pack it again", path)
    return part


def refuse_repeats(parts: list[Part]) -> None:
    """The same part given twice (by any path), or two parts that hold the same slice."""
    seen: dict[tuple, Part] = {}
    for part in parts:
        stat = os.stat(part.path)
        first = seen.setdefault((stat.st_dev, stat.st_ino), part)
        if first is not part:
            raise PackError(f"{part.path}: given twice, as {first.given!r} and as {part.given!r}; give each part "
                            "once", part.path)
    by_index: dict[int, Part] = {}
    for part in parts:
        first = by_index.setdefault(part.index, part)
        if first is not part:
            raise PackError(f"{first.path} and {part.path} both hold part {part.index} of {part.count}, the "
                            "same records (packed twice?): give one of them", part.path)


def refuse_mismatch(parts: list[Part]) -> None:
    """Parts of another source, format, count or options than the first one."""
    first = parts[0]
    for part in parts[1:]:
        if part.facts["fingerprint"] != first.facts["fingerprint"]:
            raise PackError(f"{part.path}: a part of another source than {first.path} (source fingerprints "
                            f"{part.facts['fingerprint'][:19]}... and {first.facts['fingerprint'][:19]}..., "
                            f"packed from {part.meta.source} and {first.meta.source}): the source changed between "
                            "the two packs, or they are of different sources; pack every part from the same "
                            "unchanged source", part.path)
        if part.meta.format != first.meta.format:
            raise PackError(f"{part.path}: a part in {part.meta.format}, but {first.path} is in {first.meta.format}; "
                            "every part must be packed --to the same format", part.path)
        if part.count != first.count:
            raise PackError(f"{part.path}: part {part.index} of {part.count}, but {first.path} is part "
                            f"{first.index} of {first.count}: their records overlap; pack every part with the "
                            "same N", part.path)
        differ = sorted(k for k in part.options.keys() | first.options.keys()
                        if part.options.get(k) != first.options.get(k))
        if differ:
            shown = ", ".join(f"{k}={part.options.get(k)!r} vs {first.options.get(k)!r}" for k in differ[:5])
            raise PackError(f"{part.path}: packed with other options than {first.path} ({shown}); pack every "
                            "part with the same options", part.path)
        if part.meta.checksum != first.meta.checksum:
            raise PackError(f"{part.path}: its records carry {part.meta.checksum} checksums, but {first.path}'s carry "
                            f"{first.meta.checksum}; pack every part with the same --checksum (or `packer convert` "
                            f"this one with --checksum {first.meta.checksum})", part.path)
        refuse_disagreement(part, first)
        if reencode_options(part) != reencode_options(first):
            raise PackError(f"{part.path}: re-encoded with other --max-side/--baseline-420/--quality than {first.path} "
                            f"({reencode_options(part)} vs {reencode_options(first)}); pack every part with the "
                            "same options", part.path)


def declared(part: Part) -> dict[str, object]:
    """What every part of one source declares alike, whatever its slice: the fingerprint
    vouches for none of it (it is a hash of the source, which the merge does not have)."""
    return {"the source's file count (parts.total)": part.facts["total"],
            "splits": sorted(part.meta.splits),
            "files each split lists": {name: entry["listed"] for name, entry in sorted(part.facts["splits"].items())},
            "labeled splits": sorted(name for name, split in part.meta.splits.items() if split.labeled),
            "classes": part.meta.classes,
            "folders the scan left out": part.scan_skipped}


def refuse_disagreement(part: Part, first: Part) -> None:
    """A part that declares its source otherwise than the first part: of another source
    under an edited fingerprint, or damaged; merged, its records would be misplaced or
    mislabeled."""
    theirs = declared(first)
    for what, mine in declared(part).items():
        if mine != theirs[what]:
            raise PackError(f"{part.path}: its metadata gives {what} as {brief(mine)}, but {first.path}'s gives "
                            f"{brief(theirs[what])}; parts of one pack agree on it, so one of them is of another "
                            "source or was edited: pack every part from the same source again", part.path)


def brief(value) -> str:
    text = shown(value)
    return text if len(text) <= 120 else text[:117] + "..."


def reencode_options(part: Part) -> tuple | None:
    """(max_side, quality[, form]) a part was packed with, None without --max-side or --baseline-420."""
    found = part.meta.reencode
    if found is None:
        return None
    return (found["max_side"], found["quality"], *([found["form"]] if "form" in found else []))


def merged_reencode(parts: list[Part]) -> dict | None:
    """The merged dataset's "reencode": the parts' options, their counts summed per split."""
    if parts[0].meta.reencode is None:
        return None
    counts: dict[str, int] = {}
    for part in parts:
        for name, count in part.meta.reencode["counts"].items():
            counts[name] = counts.get(name, 0) + count
    return {**parts[0].meta.reencode, "counts": counts}


def refuse_missing(parts: list[Part]) -> None:
    count = parts[0].count
    missing = sorted(set(range(count)) - {part.index for part in parts})
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise PackError(f"{len(missing)} of the {count} parts missing: part(s) {shown} (counted from 0) of the "
                        f"source {parts[0].meta.source} that the given parts are of; pack each with `packer pack "
                        f"SRC --part I/{count}` and give all {count} to merge", parts[0].path)


def checked_parts(paths: list[str]) -> list[Part]:
    """The parts at paths in index order, all of one pack; PackError naming the culprit otherwise."""
    if not paths:
        raise PackError("merge needs the parts to merge: packer merge PART... -o OUT")
    parts = [read_part(path) for path in paths]
    refuse_repeats(parts)
    refuse_mismatch(parts)
    refuse_missing(parts)
    return sorted(parts, key=lambda part: part.index)


@dataclass
class SplitPlan:
    """One split of the merge: its whole listing, and where each listed file's record is."""

    listing: SplitListing
    part: np.ndarray  # int32 per listed file: the part holding it
    local: np.ndarray  # int64 per listed file: its index in that part, -1 if it was left out
    reasons: dict[int, str]  # listed file -> why it was left out


def plan_split(name: str, parts: list[Part], tables: list[tuple[PathTable, np.ndarray]]) -> SplitPlan:
    """The split's listing rebuilt from its parts: each part's records, with the files it
    left out back at their places (skipped_at)."""
    listed = parts[0].facts["splits"][name]["listed"]
    owner = np.zeros(listed, dtype=np.int32)
    local = np.full(listed, -1, dtype=np.int64)
    labels = np.full(listed, UNLABELED, dtype=np.int32)
    reasons: dict[int, str] = {}
    pieces = []
    for k, (part, (paths, part_labels)) in enumerate(zip(parts, tables)):
        entry = part.facts["splits"][name]
        start, stop = entry["start"], entry["stop"]
        kept = np.ones(stop - start, dtype=bool)
        kept[entry["skipped_at"]] = False
        owner[start:stop] = k
        local[start:stop][kept] = np.arange(int(kept.sum()))
        labels[start:stop][kept] = part_labels
        left_out = [e for e in part.written_skipped if e.get("split") == name]
        for i, skipped in zip(entry["skipped_at"], left_out):
            reasons[start + i] = skipped["reason"]
        pieces.append(piece_paths(paths, kept, [e["path"] for e in left_out]))
    return SplitPlan(SplitListing(join_paths(pieces), labels, parts[0].meta.splits[name].labeled), owner, local,
                     reasons)


def piece_paths(paths: PathTable, kept: np.ndarray, left_out: list[str]) -> PathTable:
    """A part's stretch of the listing: its records' paths, with the left-out files' paths at their places."""
    if kept.all():
        return paths
    found, records, others = [], iter(paths), iter(left_out)
    for keep in kept.tolist():
        found.append(next(records) if keep else next(others))
    return PathTable.from_strings(found)


def join_paths(pieces: list[PathTable]) -> PathTable:
    """PathTables one after the other, as one. Each piece is cut to its own paths first: a
    table read from a part may be a view into a map of the whole part's file."""
    blob = b"\0".join(piece.to_nul_separated() for piece in pieces if len(piece))
    return PathTable(blob, path_offsets(blob, 0, len(blob))) if blob else PathTable.from_strings([])


class MergeJobs:
    """The merge's jobs in write order, as load_in_processes takes them (len, slices,
    iteration): (split, part, index in part), or the Loaded of a file left out. Held as
    numpy arrays, not a Python object per record."""

    def __init__(self, plans: dict[str, SplitPlan], orders: dict[str, np.ndarray | None]):
        self.names = list(plans)
        self.plans = plans
        splits, rows = [], []
        for k, (name, plan) in enumerate(plans.items()):
            rows.append(np.fromiter(split_order(len(plan.listing), orders[name]), dtype=np.int64,
                                    count=len(plan.listing)))
            splits.append(np.full(len(plan.listing), k, dtype=np.int16))
        self.split = np.concatenate(splits) if splits else np.zeros(0, np.int16)
        self.row = np.concatenate(rows) if rows else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.row)

    def job(self, j: int):
        name = self.names[self.split.item(j)]
        plan, row = self.plans[name], self.row.item(j)
        index = plan.local.item(row)
        if index < 0:
            return Loaded(None, 0, plan.reasons[row])
        return name, plan.part.item(row), index

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [self.job(j) for j in range(*key.indices(len(self)))]
        return self.job(key)

    def __iter__(self):
        return (self.job(j) for j in range(len(self)))


class PartsLoader:
    """load((split, part, index)) -> Loaded, a Loaded job as it is; picklable, so each pool
    worker opens its own readers of each part once."""

    def __init__(self, paths: list[str], kind: str):
        self.caches = [ReaderCache(path) for path in paths]
        self.kind = kind  # the parts' record checksum kind, and the merged dataset's

    def __call__(self, job) -> Loaded:
        if isinstance(job, Loaded):
            return job
        split, part, index = job
        data, _, _ = self.caches[part][split].read(index)  # CorruptDataError on a checksum mismatch
        return Loaded(data, record_checksums.record_checksum(data, self.kind), None)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()


def split_tables(part: Part) -> dict[str, tuple[PathTable, np.ndarray]]:
    """Each split's paths and labels in one part, checked against its metadata."""
    tables = {}
    for name, info in part.meta.splits.items():
        reader = open_reader(part.path, name)
        try:
            paths, labels = reader.paths, np.asarray(reader.labels)
        finally:
            reader.close()
        if len(paths) != info.count or len(labels) != info.count:
            raise FormatError(f"{part.path}: split {name} holds {len(paths)} paths and {len(labels)} labels for the "
                              f"{info.count} records its metadata lists; the part is damaged, pack it again",
                              part.path)
        held = np.bincount(labels[labels >= 0], minlength=len(part.meta.classes)).tolist() if info.labeled else []
        if held != list(info.class_counts):
            raise FormatError(f"{part.path}: split {name} holds {brief(held)} records per class, but its metadata "
                              f"lists {brief(info.class_counts)}; the part is damaged or was edited, pack it again",
                              part.path)
        tables[name] = (paths, labels)
    return tables


def provenance(parts: list[Part]) -> dict:
    """The merged dataset's "parts": the source's fingerprint and each part it was made from."""
    first = parts[0].facts
    return {"fingerprint": first["fingerprint"], "count": first["count"], "total": first["total"],
            "merged": [{"index": part.index, "path": part.path, "host": part.facts["host"],
                        "created": part.meta.created, "count": part.meta.count} for part in parts]}


def merge(paths: list[str], out: str, *, force: bool = False, workers: int | None = None,
          progress: bool | None = None, staging_dir: str | None = None,
          storage_options: dict | None = None) -> PackResult:
    """Merge the parts at paths (any order) into out, a path or a URL (s3://bucket/key: merged in
    a folder under staging_dir, then uploaded with storage_options; packer.destination): the
    dataset a single pack of their source gives."""
    parts = checked_parts(paths)  # refused before anything is written, wherever out is
    destination = destination_for(out, lambda: out, force=force, staging_dir=staging_dir,
                                  storage_options=storage_options)
    sources = [part.path for part in parts]
    return destination.write(parts[0].meta.format, sources, lambda local, force: merge_here(
        parts, local, force=force, workers=workers, progress=progress))


def merge_here(parts: list[Part], out: str, *, force: bool = False, workers: int | None = None,
               progress: bool | None = None) -> PackResult:
    """merge() of checked parts to a local out, which merge()'s destination checked."""
    start = time.perf_counter()
    first = parts[0]
    fmt = first.meta.format
    out = os.path.abspath(os.fspath(out))
    workers = workers or available_cores()
    tables = [split_tables(part) for part in parts]
    names = sorted(first.meta.splits)
    plans = {name: plan_split(name, parts, [t[name] for t in tables]) for name in names}
    seed = first.meta.params.get("shuffle_seed")
    orders = {name: write_order(len(plan.listing), name, seed) for name, plan in plans.items()}
    jobs = MergeJobs(plans, orders)
    options = {option.name: first.meta.params.get(option.name) for option in FORMATS[fmt].options}
    on_error = "skip" if any(plan.reasons for plan in plans.values()) else "fail"

    advice: list[str] = []  # the writer's (wds: too few shards for this machine)
    with InterruptGuard(out) as guard:
        def fill(writer) -> Metadata:
            load = PartsLoader([part.path for part in parts], first.meta.checksum)
            try:
                loaded = load_in_processes(jobs, load, workers, chunk=RECORD_CHUNK)
                written = write_listings(writer, {name: plan.listing for name, plan in plans.items()},
                                         len(first.meta.classes), loaded, on_error, progress, orders, guard)
            finally:
                load.close()
            advice.extend(written.warnings)
            return Metadata(format=fmt, classes=first.meta.classes, splits=written.splits, source=first.meta.source,
                            created=now_utc(), packer_version=__version__, params=first.meta.params,
                            skipped=first.scan_skipped + written.skipped, parts=provenance(parts),
                            reencode=merged_reencode(parts), checksum=first.meta.checksum)

        meta = write_dataset(fmt, out, force, options, fill, first.meta.checksum)
    return PackResult(out, meta, time.perf_counter() - start, advice)
