"""info and verify: what a packed dataset holds, and whether it is intact and matches its source."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .check import MAX_PIXELS, problem
from .errors import PackError
from .formats import FORMATS, ReaderCache, detect_format, open_reader, read_metadata
from .cores import available_cores
from .engine import load_in_processes
from .records import UNLABELED, Metadata, PathTable
from .scan import Source, scan_source

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


def info(path: str) -> dict:
    """The metadata of a packed dataset plus where and how big it is, as one JSON-able dict."""
    meta = read_metadata(path)
    facts = {**meta.to_dict(), "path": os.path.abspath(path), "disk_bytes": disk_bytes(path)}
    if meta.format == "wds":  # per split: shard count and sizes (readers deal whole shards to workers)
        from .formats.wds import shard_info

        for split, shards in shard_info(path).items():
            facts["splits"][split]["shards"] = shards
    return facts


@dataclass
class VerifyReport:
    checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class BlockVerifier:
    """The problems found in one block of records, (split, start, stop), of one dataset.

    Picklable without its readers, so each worker process of the engine opens its own once
    and keeps them for every block it checks. Images over max_pixels (the limit the dataset
    was packed with) count as problems; against is the source folder to compare with."""

    def __init__(self, path: str, check: str, against: str | None, max_pixels: int = MAX_PIXELS):
        self.readers = ReaderCache(path)
        self.check, self.against, self.max_pixels = check, against, max_pixels

    def __call__(self, block: tuple[str, int, int]) -> list[str]:
        split, start, stop = block
        reader = self.readers[split]
        problems = []
        for i in range(start, stop):
            where = f"{split}/{i}"
            try:
                data, label, relpath = reader.read(i)
            except PackError as exc:
                problems.append(str(exc))
                continue
            if relpath != reader.paths[i] or label != reader.labels[i]:
                problems.append(f"{where} ({relpath}): record disagrees with the split's path/label index")
            reason = problem(data, self.check, self.max_pixels)
            if reason:
                problems.append(f"{where} ({relpath}): {reason}")
            if self.against is not None:
                problems += compare_with_source(self.against, relpath, data, where)
        return problems

    def close(self) -> None:
        self.readers.close()


def compare_with_source(root: str, relpath: str, data: bytes, where: str) -> list[str]:
    # Imported here only to keep this change to one function; a FIFO or device in SRC must not hang verify.
    from .errors import BadImageError
    from .source_io import read_regular_file

    try:
        original = read_regular_file(os.path.join(root, relpath))
    except FileNotFoundError:
        return []  # reported once, as removed, by the listing comparison
    except OSError as exc:
        return [f"{relpath}: cannot read the source file ({exc.strerror or exc})"]
    except BadImageError as exc:
        return [f"{relpath}: cannot compare with the source file: {exc.reason}"]
    if original != data:
        return [f"{where} ({relpath}): differs from the source file ({len(data)} stored bytes, "
                f"{len(original)} in SRC)"]
    return []


def verify(path: str, against: str | None = None, check: str = "full",
           workers: int | None = None) -> VerifyReport:
    """Re-read every record, check its checksum and image, and compare with the source if given."""
    fmt = detect_format(path)
    meta = read_metadata(path)
    report = VerifyReport()
    report.problems += FORMATS[fmt].check_files(path)  # the container's own (wds: shard sizes, SHA-256s)
    tables = split_tables(path, meta, report)
    root = None
    if against is not None:
        source = scan_source(against)
        root = source.root
        compare_listings(meta, tables, source, report)
    max_pixels = packed_max_pixels(meta)
    blocks = [(split, start, min(start + BLOCK, meta.splits[split].count))
              for split in tables for start in range(0, meta.splits[split].count, BLOCK)]
    workers = min(workers or available_cores(), max(len(blocks), 1))
    verifier = BlockVerifier(os.path.abspath(path), check, root, max_pixels)
    try:
        for found in load_in_processes(blocks, verifier, workers, chunk=1):
            report.problems += found
    finally:
        verifier.close()
    report.checked = sum(meta.splits[split].count for split in tables)
    return report


def packed_max_pixels(meta: Metadata) -> int:
    """The pixel limit the dataset was packed with (its params), else the default."""
    value = meta.params.get("max_pixels")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else MAX_PIXELS


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
                report.problems.append(f"split {split}: {len(paths)} paths and {len(labels)} labels for the "
                                       f"{info.count} records the metadata lists (its records were not read); "
                                       "the dataset is damaged, re-pack it")
                continue
            reader.open()  # every other table loads, and is checked, here
            if not reader.tables_checked:
                report.notes.append(f"split {split}: tables not covered by checksums (packed by an older packer); "
                                    "`packer convert` or re-pack to add them")
        except PackError as exc:
            report.problems.append(f"split {split}: {exc} (its records were not read)")
            continue
        finally:
            if reader is not None:
                reader.close()
        report.problems += label_problems(split, labels, len(meta.classes), info.labeled)
        tables[split] = (paths, labels)
    return tables


def label_problems(split: str, labels: np.ndarray, n_classes: int, labeled: bool) -> list[str]:
    """Labels that name no class (or, in an unlabeled split, any label but -1)."""
    wrong = (labels < 0) | (labels >= n_classes) if labeled else labels != UNLABELED
    if not wrong.any():
        return []
    first = int(np.flatnonzero(wrong)[0])
    allowed = f"0 to {n_classes - 1}" if labeled else "-1 (unlabeled)"
    return [f"split {split}: {int(wrong.sum())} label(s) outside {allowed}, first record {first} with label "
            f"{int(labels[first])}; the label table is damaged, re-pack the dataset"]


def class_of(label: int, classes: list[str]) -> str | None:
    """The class name a label stands for, None for unlabeled; a label naming no class gets a
    placeholder (label_problems reports it) so a comparison shows it instead of failing."""
    if label == UNLABELED:
        return None
    return classes[label] if 0 <= label < len(classes) else f"<label {label}: no such class>"


def compare_listings(meta: Metadata, tables: dict, source: Source, report: VerifyReport) -> None:
    """Files added to or removed from SRC since packing, and label changes."""
    if sorted(meta.splits) != sorted(source.splits):
        report.problems.append(f"splits differ: packed {sorted(meta.splits)}, SRC has {sorted(source.splits)}")
    skipped = {(s.get("split"), s["path"]): s["reason"] for s in meta.skipped}
    for split in sorted(set(tables) & set(source.splits)):
        paths, labels = tables[split]
        packed = {p: class_of(l, meta.classes) for p, l in zip(paths, labels.tolist())}
        listing = source.splits[split]
        current = {p: source.classes[l] if l >= 0 else None for p, l in zip(listing.paths, listing.labels)}
        for relpath in sorted(current.keys() - packed.keys()):
            reason = skipped.get((split, relpath))
            if reason is None:
                report.problems.append(f"{relpath}: in SRC but not packed (added since packing?)")
            else:
                report.notes.append(f"{relpath}: skipped at pack time ({reason})")
        for relpath in sorted(packed.keys() - current.keys()):
            report.problems.append(f"{relpath}: packed but no longer in SRC (removed since packing?)")
        for relpath in sorted(packed.keys() & current.keys()):
            if packed[relpath] != current[relpath]:
                report.problems.append(f"{relpath}: packed with class {packed[relpath]!r}, "
                                       f"SRC now has it under {current[relpath]!r}")
