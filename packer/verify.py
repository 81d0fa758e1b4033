"""info and verify: what a packed dataset holds, and whether it is intact and matches its source.

Records are compared with their source byte for byte, except in a dataset packed with
--max-side or --baseline-420 (Metadata.reencode): there a source image the rule of
packer.reencode re-encodes (over max_side, or not in baseline 4:2:0 form) must be stored
re-encoded, a decodable JPEG of the size packer.reencode derives from the source's size
and orientation (its long side exactly, its short side to within a pixel of rounding,
which a second re-encode by `convert --max-side` can shift), and every other one byte
for byte. Without --against, such a dataset's images are checked to be no larger than
max_side and, with --baseline-420, to be in that form (their headers say so).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .check import MAX_PIXELS, packed_max_pixels, problem, sniff
from .errors import BadImageError, PackError
from .formats import FORMATS, ReaderCache, detect_format, open_reader, read_metadata
from .cores import available_cores
from .engine import load_in_processes
from .records import UNLABELED, Metadata, PathTable
from .jpeg_form import jpeg_form
from .reencode import MAX_SIDE_LIMIT, Reencode, expected_size, stored_size
from .remote.source import remote_for
from .scan import DEFAULT_SPLIT, Source, scan_source
from .source_digest import carried, digest
from .source_io import read_regular_file

BLOCK = 256  # records per verification task


def disk_bytes(path: str) -> int:
    """Bytes the dataset's own files take; symlinks count as links (they may lead anywhere)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(own_size(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def own_size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:  # removed while we walked
        return 0


def info(path: str, storage_options: dict | None = None) -> dict:
    """The metadata of a packed dataset plus where and how big it is, as one JSON-able dict.
    path may be a URL (its disk_bytes are then None: nothing is listed). For a local
    dataset, "forms" is the census of its JPEG forms in a sample (census below)."""
    remote = remote_for(path, storage_options=storage_options)
    if remote is None:
        meta = read_metadata(path)
        facts = {**meta.to_dict(), "path": os.path.abspath(path), "disk_bytes": disk_bytes(path),
                 "forms": census(path, meta)}
    else:
        meta = read_metadata(path, storage_options=storage_options)
        facts = {**meta.to_dict(), "path": path, "disk_bytes": None}
    for split, extra in FORMATS[meta.format].info_facts(path, remote).items():
        facts["splits"][split].update(extra)
    return facts


# Kinds of problem, counted in VerifyReport.kinds so a long list can be summed up.
DAMAGED = "damaged"  # a record, table or container file that does not read back intact
DIFFERS = "differs from SRC"
NOT_PACKED = "in SRC but not packed"
NOT_IN_SRC = "packed but not in SRC"
CLASS_CHANGED = "class changed in SRC"
SRC_UNREADABLE = "SRC file unreadable"
SPLITS_DIFFER = "splits differ"
CLASSES_DIFFER = "classes differ"
# With --against: how each record found the same as its source was compared (not a problem).
HOW = "compared"
BY_BYTES = "byte for byte"
BY_DIGEST = "re-encoded, by their source's digest and their size"
BY_SIZE = "re-encoded, by size alone (they carry no source digest: packed by an earlier version)"
COMPARISONS = (BY_BYTES, BY_DIGEST, BY_SIZE)


@dataclass
class VerifyReport:
    checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)  # kind -> how many of problems are of it
    advice: list[str] = field(default_factory=list)  # what to do about the problems found
    reencoded: bool = False  # packed with --max-side or --baseline-420: some records are compared by size
    compared: Counter = field(default_factory=Counter)  # with --against: how (BY_*) -> records found the same

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, problems: list[str]) -> None:
        if problems:
            self.problems += problems
            self.kinds[kind] += len(problems)

    def to_dict(self, first: int = 20) -> dict:
        """The report as one JSON-able object: counts, the first problems, notes and advice."""
        return {"ok": self.ok, "checked": self.checked, "problem_count": len(self.problems),
                "problems_by_kind": dict(self.kinds), "first_problems": self.problems[:first],
                "notes": self.notes, "advice": self.advice, "compared": dict(self.compared)}


class BlockVerifier:
    """The problems found in one block of records, (split, start, stop), of one dataset.

    Picklable without its readers, so each worker process of the engine opens its own once
    and keeps them for every block it checks. Images over max_pixels (the limit the dataset
    was packed with) count as problems; against is the source folder to compare with.
    reencode: the dataset's re-encoding rule (Metadata.reencode), None when it has none."""

    def __init__(self, path: str, check: str, against: str | None, max_pixels: int = MAX_PIXELS,
                 reencode: Reencode | None = None):
        self.readers = ReaderCache(path)
        self.check, self.against, self.max_pixels = check, against, max_pixels
        self.reencode = reencode

    def __call__(self, block: tuple[str, int, int]) -> list[tuple[str, str]]:
        split, start, stop = block
        reader = self.readers[split]
        problems = []
        for i in range(start, stop):
            where = f"{split}/{i}"
            try:
                data, label, relpath = reader.read(i)
            except PackError as exc:
                problems.append((DAMAGED, str(exc)))
                continue
            if relpath != reader.paths[i] or label != reader.labels[i]:
                problems.append((DAMAGED, f"{where} ({relpath}): record disagrees with the split's path/label index"))
            reason = problem(data, self.check, self.max_pixels)
            if reason:
                problems.append((DAMAGED, f"{where} ({relpath}): {reason}"))
            elif self.reencode is not None:
                problems += outside_rule(data, self.reencode, f"{where} ({relpath})", self.max_pixels)
            if self.against is not None:
                problems += compare_with_source(self.against, relpath, data, where, self.reencode,
                                                self.check == "full", self.max_pixels)
        return problems

    def close(self) -> None:
        self.readers.close()


def outside_rule(data: bytes, spec: Reencode, where: str, max_pixels: int) -> list[tuple[str, str]]:
    """A problem if the stored image is larger than the max side its dataset was packed
    with, or, packed with --baseline-420, not in that form."""
    try:
        width, height = stored_size(data, max_pixels)
    except BadImageError as exc:
        return [(DAMAGED, f"{where}: {exc.reason}")]
    if max(width, height) > spec.max_side:
        return [(DAMAGED, f"{where}: stored image is {width}x{height}, over the max side {spec.max_side} the dataset "
                          "was packed with")]
    form = jpeg_form(data) if spec.baseline_420 else None
    if spec.baseline_420 and (form is None or not form.baseline_420):
        found = "not a JPEG" if form is None else (
            f"a {'baseline' if form.baseline else 'progressive' if form.progressive else 'non-baseline'} "
            f"{form.precision}-bit {form.colorspace} {form.subsampling} JPEG")
        return [(DAMAGED, f"{where}: stored image is {found}, but the dataset was packed with --baseline-420 "
                          "(baseline YCbCr 4:2:0 or grayscale JPEGs only)")]
    return []


def compare_with_source(root: str, relpath: str, data: bytes, where: str, reencode: Reencode | None = None,
                        decoded: bool = False, max_pixels: int = MAX_PIXELS) -> list[tuple[str, str]]:
    """Problems of one record against its source file: bytes, or for one re-encoded under
    the rule reencode, its size (decoded: the record has already been fully decoded)."""
    # read_regular_file: a FIFO or device in SRC must not hang verify.
    try:
        original = read_regular_file(os.path.join(root, relpath))
    except FileNotFoundError:
        return []  # reported once, as removed, by the listing comparison
    except OSError as exc:
        return [(SRC_UNREADABLE, f"{relpath}: cannot read the source file ({exc.strerror or exc})")]
    except BadImageError as exc:
        return [(SRC_UNREADABLE, f"{relpath}: cannot compare with the source file: {exc.reason}")]
    if reencode is not None:
        return compare_reencoded(original, data, f"{where} ({relpath})", reencode, decoded, max_pixels)
    if original != data:
        return [(DIFFERS, f"{where} ({relpath}): differs from the source file ({len(data)} stored bytes, "
                          f"{len(original)} in SRC)")]
    return [(HOW, BY_BYTES)]


def compare_reencoded(original: bytes, data: bytes, where: str, spec: Reencode, decoded: bool,
                      max_pixels: int) -> list[tuple[str, str]]:
    """A record of a dataset packed with --max-side or --baseline-420 against its source:
    re-encoded to the expected size if the rule re-encodes the source, byte-identical if not."""
    try:
        expected = expected_size(original, spec, max_pixels)
    except BadImageError as exc:
        return [(DIFFERS, f"{where}: the source file is no longer a readable image ({exc.reason})")]
    if expected is None:
        if original != data:
            return [(DIFFERS, f"{where}: differs from the source file ({len(data)} stored bytes, {len(original)} "
                              f"in SRC; {rule_text(spec, kept=True)}, so it is stored as it is)")]
        return [(HOW, BY_BYTES)]
    if original == data:
        return [(DIFFERS, f"{where}: stored as it is, but the source is {rule_text(spec, kept=False)} "
                          "and must be stored re-encoded")]
    try:
        size = stored_size(data, max_pixels)
    except BadImageError as exc:
        return [(DAMAGED, f"{where}: {exc.reason}")]
    if not re_encoded_size_fits(size, expected):
        return [(DIFFERS, f"{where}: stored image is {size[0]}x{size[1]}, re-encoding the source under the max side "
                          f"{spec.max_side} gives {expected[0]}x{expected[1]} (by its size and orientation)")]
    reason = None if decoded else problem(data, "full", max_pixels)
    if reason is None and sniff(data) != "jpeg":
        reason = "a re-encoded record that is not a JPEG"
    if reason is not None:
        return [(DAMAGED, f"{where}: {reason}")]
    recorded = carried(data)
    if recorded is None:
        return [(HOW, BY_SIZE)]
    if recorded != digest(original):
        return [(DIFFERS, f"{where}: re-encoded from another file: the source digest it carries ({recorded}) is not "
                          f"that of the file in SRC ({digest(original)}), though the sizes agree")]
    return [(HOW, BY_DIGEST)]


def re_encoded_size_fits(size: tuple[int, int], expected: tuple[int, int]) -> bool:
    """The long side exactly as expected, each side within one pixel of rounding."""
    return max(size) == max(expected) and all(abs(got - want) <= 1 for got, want in zip(size, expected))


def verify(path: str, against: str | None = None, check: str = "full",
           workers: int | None = None, progress: bool | None = None) -> VerifyReport:
    """Re-read every record, check its checksum and image, and compare with the source if given.

    progress: a bar on stderr (None: only when stderr is a terminal, as pack's). The report
    counts its problems per kind and ends with advice on what to do about them.
    """
    fmt = detect_format(path)
    meta = read_metadata(path)
    report = VerifyReport()
    report.add(DAMAGED, FORMATS[fmt].check_files(path))  # the container's own (wds: shard sizes, SHA-256s)
    tables = split_tables(path, meta, report)
    root = None
    if against is not None:
        source = scan_source(against, on_error="skip")  # an unreadable folder is reported, not fatal
        root = source.root
        compare_listings(meta, tables, source, report)
    max_pixels = packed_max_pixels(meta.params)
    reencode = None if meta.reencode is None else Reencode.from_record(meta.reencode)
    if reencode is not None:
        report.reencoded = True
        report.notes.append(reencode_note(meta.reencode, against))
    blocks = [(split, start, min(start + BLOCK, meta.splits[split].count))
              for split in tables for start in range(0, meta.splits[split].count, BLOCK)]
    workers = min(workers or available_cores(), max(len(blocks), 1))
    verifier = BlockVerifier(os.path.abspath(path), check, root, max_pixels, reencode)
    bar = progress_bar(sum(stop - start for _, start, stop in blocks), progress)
    try:
        for (_, start, stop), found in zip(blocks, load_in_processes(blocks, verifier, workers, chunk=1)):
            for kind, message in found:
                if kind == HOW:
                    report.compared[message] += 1
                else:
                    report.add(kind, [message])
            bar.update(stop - start)
    finally:
        bar.close()
        verifier.close()
    report.checked = sum(meta.splits[split].count for split in tables)
    report.advice = advice(report, meta, against)
    return report


def rule_text(spec: Reencode, kept: bool) -> str:
    """What the re-encoding rule says of a source image it keeps (kept) or re-encodes."""
    parts = []
    if spec.max_side < MAX_SIDE_LIMIT:
        parts.append(f"not over the max side {spec.max_side}" if kept else f"over the max side {spec.max_side}")
    if spec.baseline_420:
        parts.append("already baseline 4:2:0" if kept else "not baseline 4:2:0")
    return (" and " if kept else " or ").join(parts)


def reencode_note(reencode: dict, against: str | None) -> str:
    spec = Reencode.from_record(reencode)
    count = sum(reencode["counts"].values())
    which = " or ".join(([f"over {spec.max_side} px"] if spec.max_side < MAX_SIDE_LIMIT else [])
                        + (["not baseline 4:2:0"] if spec.baseline_420 else []))
    checked = []
    if spec.max_side < MAX_SIDE_LIMIT:
        checked.append("no larger than that")
    if spec.baseline_420:
        checked.append("baseline 4:2:0 or grayscale JPEGs")
    how = ("compared with SRC by the digest of their source each carries and by decoded size (by size alone where "
           "one carries no digest: re-encoded before records carried one), the others byte for byte"
           if against is not None
           else "checked to be " + " and ".join(checked))
    return f"{count} records were re-encoded when packed (images {which}, JPEG quality {spec.quality}): {how}"


def progress_bar(total: int, enabled: bool | None):
    """A tqdm bar in records, on stderr: on a terminal only when enabled is None."""
    from tqdm import tqdm

    return tqdm(total=total, unit="record", disable=None if enabled is None else not enabled,
                smoothing=0.1, dynamic_ncols=True)


def advice(report: VerifyReport, meta: Metadata, against: str | None) -> list[str]:
    """What to do about the problems found, most likely cause first."""
    kinds, found = report.kinds, []
    compared = kinds[NOT_PACKED] + kinds[NOT_IN_SRC] + kinds[DIFFERS] + kinds[CLASS_CHANGED] + kinds[CLASSES_DIFFER]
    if against is not None and (kinds[SPLITS_DIFFER] or (kinds[NOT_IN_SRC] and kinds[NOT_IN_SRC] >= report.checked)):
        found.append(f"no packed file is in {against}: is --against the folder it was packed from? "
                     f"(the metadata says {meta.source})")
    elif compared or kinds[SPLITS_DIFFER]:
        found.append(f"{against} changed since packing: re-pack it to include the changes, or verify against "
                     f"the folder it was packed from ({meta.source})")
    if kinds[SRC_UNREADABLE]:
        found.append("some source files could not be read: fix their permissions, or replace them")
    if kinds[DAMAGED]:
        found.append("the dataset is damaged: restore it from a copy, or re-pack it from its source")
    return found


def split_tables(path: str, meta: Metadata, report: VerifyReport) -> dict[str, tuple[PathTable, np.ndarray]]:
    """Each split's paths and labels, read and checked once. A split whose tables are
    unreadable or do not fit its metadata is reported once here, and its records are not
    read (each read would fail the same way)."""
    tables = {}
    for split, info in meta.splits.items():
        reader = None
        try:
            reader = open_reader(path, split)
            paths, labels = reader.paths, reader.labels
            if len(paths) != info.count or len(labels) != info.count:
                report.add(DAMAGED, [f"split {split}: {len(paths)} paths and {len(labels)} labels for the "
                                       f"{info.count} records the metadata lists (its records were not read); "
                                       "the dataset is damaged, re-pack it"])
                continue
            reader.check_tables()  # every other table loads, and is checked whole (CRC-32s), here
            if not reader.tables_checked:
                report.notes.append(f"split {split}: tables not covered by checksums (packed by an older packer); "
                                    "`packer convert` or re-pack to add them")
        except PackError as exc:
            report.add(DAMAGED, [f"split {split}: {exc} (its records were not read)"])
            continue
        finally:
            if reader is not None:
                reader.close()
        tables[split] = (paths, labels)
    return tables


def class_of(label: int, classes: list[str]) -> str | None:
    """The class name a label stands for, None for unlabeled (labels from split_tables: the
    reader has checked each names a class)."""
    return None if label == UNLABELED else classes[label]


def compare_listings(meta: Metadata, tables: dict, source: Source, report: VerifyReport) -> None:
    """Files added to or removed from SRC since packing, and label changes.

    Streams: the packed and the current listing are both in ImageFolder order, so they are
    joined as two sorted streams (listing_changes), a path at a time, not held as
    dictionaries of every path. Problems are reported sorted by path, as they always were."""
    unreadable = {(s["split"], s["path"]): s["reason"] for s in source.skipped}  # folders SRC cannot list now
    under_unreadable: Counter = Counter()
    unlisted = {split for split, folder in unreadable if folder == split and split in meta.splits}
    for split in unlisted:  # a split's own folder: each of its records is still checked by path
        under_unreadable[split, split] = meta.splits[split].count
    if sorted(meta.splits) != sorted(set(source.splits) | unlisted):
        report.add(SPLITS_DIFFER, [f"splits differ: packed {sorted(meta.splits)}, SRC has {sorted(source.splits)}"])
    from_file = isinstance(meta.params.get("labels"), dict)  # its classes came from a label file
    # A class folder added or gone; not knowable while a split's folder cannot be listed.
    if source.classes and not from_file and not unlisted and meta.classes != source.classes:
        report.add(CLASSES_DIFFER, [classes_change(meta.classes, source.classes)])
    skipped = {(s.get("split"), s["path"]): s["reason"] for s in meta.skipped}
    for split in sorted(set(tables) & set(source.splits)):
        paths, labels = tables[split]
        listing = source.splits[split]
        packed = ((p, class_of(l, meta.classes)) for p, l in zip(paths, labels_of(labels)))
        current = ((p, source.classes[l] if l >= 0 else None) for p, l in zip(listing.paths, labels_of(listing.labels)))
        try:
            added, removed, changed = listing_changes(split, packed, current)
        except _Unordered:  # not in ImageFolder order (a pack by another tool): compared the long way
            added, removed, changed = listing_changes_unordered(paths, labels, listing, source.classes, meta.classes)
        for relpath in added:
            reason = skipped.get((split, relpath))
            if reason is None:
                report.add(NOT_PACKED, [f"{relpath}: in SRC but not packed (added since packing?)"])
            else:
                report.notes.append(f"{relpath}: skipped at pack time ({reason})")
        for relpath in removed:
            folder = unlisted_folder(split, relpath, unreadable)
            if folder is not None:  # not listed, not gone: its record check reads the file itself
                under_unreadable[folder] += 1
                continue
            report.add(NOT_IN_SRC, [f"{relpath}: packed but no longer in SRC (removed since packing?)"])
        if labeled_from_file(meta, split, listing):
            report.notes.append(f"split {split}: labels came from {meta.params['labels'].get('file')} at pack "
                                "time, not from folders; only file contents and names were compared")
            continue
        for relpath, was, now in changed:
            report.add(CLASS_CHANGED, [f"{relpath}: packed with class {was!r}, SRC now has it under {now!r}"])
    report_unreadable(unreadable, skipped, under_unreadable, report)


def classes_change(packed: list[str], now: list[str]) -> str:
    added, gone = sorted(set(now) - set(packed)), sorted(set(packed) - set(now))
    return (f"classes differ: packed {len(packed)}, SRC now has {len(now)} (added {shown_names(added)}, gone "
            f"{shown_names(gone)}): a pack of SRC now would number its labels differently")


def shown_names(names: list[str], first: int = 5) -> str:
    more = f" and {len(names) - first} more" if len(names) > first else ""
    return (", ".join(repr(name) for name in names[:first]) or "none") + more


def unlisted_folder(split: str, relpath: str, unreadable: dict) -> tuple[str, str] | None:
    """The folder above relpath that SRC cannot list now, as (split, path), or None."""
    top = relpath
    while "/" in top:
        top = top.rpartition("/")[0]
        if (split, top) in unreadable:
            return split, top
    return None


def report_unreadable(unreadable: dict, skipped: dict, packed: Counter, report: VerifyReport) -> None:
    """SRC's folders that cannot be listed now: noted when they were skipped at pack time too,
    or when their packed files were each checked; a problem when nothing in them can be seen."""
    for (split, folder), reason in sorted(unreadable.items()):
        if (split, folder) in skipped:
            report.notes.append(f"{folder}: skipped at pack time ({skipped[split, folder]}), and still unreadable")
        elif packed[split, folder]:
            report.notes.append(f"{folder}: {reason}: its {packed[split, folder]} packed files were checked one by "
                                "one, but files added to it since packing cannot be seen; fix its permissions")
        else:
            report.add(SRC_UNREADABLE, [f"{folder}: {reason}: not packed, and what it holds cannot be compared"])


class _Unordered(Exception):
    """A listing that is not in ImageFolder order."""


def imagefolder_key(split: str, relpath: str) -> tuple[str, str, str]:
    """Where relpath comes in its split's ImageFolder order (packer.scan): by class folder,
    then by the folder it is in, then by name."""
    top, _, name = relpath.rpartition("/")
    parts = top.split("/")
    cls = parts[0] if split == DEFAULT_SPLIT else (parts[1] if len(parts) > 1 else "")
    return cls, top, name


def keyed(split: str, entries):
    """(key, path, class) of each (path, class) of a listing, raising _Unordered if the keys go down."""
    last = None
    for relpath, cls in entries:
        key = imagefolder_key(split, relpath)
        if last is not None and key <= last:
            raise _Unordered
        last = key
        yield key, relpath, cls


def listing_changes(split: str, packed, current) -> tuple[list, list, list]:
    """(paths only in current, paths only in packed, (path, packed class, current class) of
    those whose class changed), each sorted by path, from two listings of (path, class) in
    ImageFolder order, joined as they stream."""
    added, removed, changed = [], [], []
    packed, current = keyed(split, packed), keyed(split, current)
    p, c = next(packed, None), next(current, None)
    while p is not None or c is not None:
        if c is None or (p is not None and p[0] < c[0]):
            removed.append(p[1])
            p = next(packed, None)
        elif p is None or c[0] < p[0]:
            added.append(c[1])
            c = next(current, None)
        else:
            if p[2] != c[2]:
                changed.append((p[1], p[2], c[2]))
            p, c = next(packed, None), next(current, None)
    return sorted(added), sorted(removed), sorted(changed)


def listing_changes_unordered(paths, labels, listing, classes: list[str], packed_classes: list[str]):
    """listing_changes for listings in no known order: through dictionaries of every path."""
    packed = {p: class_of(l, packed_classes) for p, l in zip(paths, labels_of(labels))}
    current = {p: classes[l] if l >= 0 else None for p, l in zip(listing.paths, labels_of(listing.labels))}
    changed = [(p, packed[p], current[p]) for p in sorted(packed.keys() & current.keys()) if packed[p] != current[p]]
    return sorted(current.keys() - packed.keys()), sorted(packed.keys() - current.keys()), changed


def labels_of(labels: np.ndarray, block: int = 1 << 16):
    """The labels as Python ints, a block at a time (not a list of them all)."""
    return (label for start in range(0, len(labels), block) for label in labels[start:start + block].tolist())


def labeled_from_file(meta: Metadata, split: str, listing) -> bool:
    """Whether split is flat in SRC and was labeled by the label file recorded in params."""
    return (not listing.labeled and meta.splits[split].labeled and isinstance(meta.params.get("labels"), dict))


SAMPLE = 1000  # records info reads for its census: a few MB, enough for shares to +-3 points


def census(path: str, meta, sample: int = SAMPLE) -> dict:
    """How many of `sample` records, spread evenly over all splits in storage order, are in
    each form: {"sampled", "jpeg", "baseline_420", "hardware", "progressive",
    "subsampling": {"4:2:0": n, ...}, "unreadable"}. Reads those records' bytes (headers
    parsed only); a record that cannot be read (damaged, a shard missing) is counted as
    unreadable, not raised: info describes a dataset, verify judges it."""
    total = meta.count
    picks = sorted({k * total // sample for k in range(sample)}) if total > sample else range(total)
    bounds, start = [], 0
    for name, split in meta.splits.items():
        bounds.append((name, start, start + split.count))
        start += split.count
    counts = {"sampled": 0, "jpeg": 0, "baseline_420": 0, "hardware": 0, "progressive": 0, "subsampling": {},
              "unreadable": 0}
    readers = ReaderCache(path)
    try:
        for k in picks:
            name, first = next((name, lo) for name, lo, hi in bounds if lo <= k < hi)
            counts["sampled"] += 1
            try:
                data = readers[name].read(k - first)[0]
            except (PackError, OSError):
                counts["unreadable"] += 1
                continue
            form = jpeg_form(data)
            if form is None:
                continue
            counts["jpeg"] += 1
            counts["baseline_420"] += form.baseline_420
            counts["hardware"] += form.hardware
            counts["progressive"] += form.progressive
            key = form.subsampling if form.colorspace in ("YCbCr", "Gray") else form.colorspace
            counts["subsampling"][key] = counts["subsampling"].get(key, 0) + 1
    finally:
        readers.close()
    return counts
