"""Label files for flat (unlabeled) split folders, such as ImageNet's official val/.

Accepted shapes, told apart by content:
  LOC CSV    header `ImageId,PredictionString`; the class is the first token of
             PredictionString; ImageId is the file name without its extension
             (ImageNet's LOC_val_solution.csv)
  CSV        `filename,class` rows; class is a class name. A first row that names no image
             and no class is a header, whatever its words (filename,class; image,label; ...)
  JSON       one object {"filename": "class"}
  integers   one integer per line, for the split's files in sorted name order
             (ILSVRC2012_validation_ground_truth.txt); only with index_base 0 or 1, naming
             indexes into packer's sorted class list. ILSVRC's own indexes follow its synset
             order, not the sorted folder order, so without index_base the file is refused.

A class given as an integer in a CSV or JSON is a 0-based index into packer's sorted class
list, unless some class name is itself an integer (then every value is taken as a name).
Keys are file names, or paths relative to the split folder. The file is untrusted: its size,
its encoding (UTF-8), its names (no absolute paths, no "..", no control characters) and every
class are checked, and a class missing from the class list is an error, never a new class.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass

from .check import IMAGE_EXTENSIONS
from .errors import BadImageError, SourceError
from .source_io import read_regular_file

MAX_BYTES = 512 * 1024 * 1024  # ImageNet's LOC_val_solution.csv is about 2 MB
MAX_NAME = 4096
INDEX_BASES = (0, 1)
LOC_HEADER = ["ImageId", "PredictionString"]
INTEGER = re.compile(r"[+-]?[0-9]{1,9}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass
class LabelFile:
    """A parsed label file: class index per key, or per sorted position (by_position)."""

    name: str  # the file's base name, as recorded in the metadata
    sha256: str
    shape: str  # "loc", "csv", "json" or "integers"
    by_key: dict[str, int]  # key (file name, path in the split, or stem for "loc") -> class index
    by_position: list[int] | None = None  # "integers": class index of each file in sorted order
    path: str = ""  # where it was read from, for messages

    @property
    def keys_are_stems(self) -> bool:
        return self.shape == "loc"

    def params(self) -> dict:
        return {"file": self.name, "sha256": self.sha256, "shape": self.shape}


def read_label_file(path: str | os.PathLike, classes: list[str], index_base: int | None = None) -> LabelFile:
    """Parse the label file at path against the class list (see the module docstring)."""
    path = os.fspath(path)
    raw = read_bounded(path)
    name, digest = os.path.basename(path), hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: label file is not UTF-8 text (byte {exc.start}); "
                          "give a CSV, JSON or text file", path) from exc
    if "\x00" in text:
        raise SourceError(f"{path}: label file holds NUL bytes (binary?); give a CSV, JSON or text file", path)
    if index_base is not None and index_base not in INDEX_BASES:
        raise SourceError(f"labels index base must be 0 or 1, not {index_base!r}", path)
    lookup = ClassLookup(classes, path)
    found = parse_shape(text, lookup, classes, index_base, path)
    if index_base is not None and found[0] != "integers":
        raise SourceError(f"{path}: --labels-index-base applies to a list of class indexes, and this is a "
                          f"{found[0]} label file: leave it out", path)
    return LabelFile(name, digest, *found, path=path)


def parse_shape(text: str, lookup: "ClassLookup", classes: list[str], index_base: int | None,
                path: str) -> tuple:
    """(shape, by_key, by_position) of the label file's text."""
    stripped = text.lstrip()
    if stripped.startswith("{") or stripped.startswith("["):
        return "json", parse_json(text, lookup, path), None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise SourceError(f"{path}: label file is empty", path)
    if all(INTEGER.fullmatch(line.strip()) for line in lines):
        return "integers", {}, parse_integers(lines, classes, index_base, path)
    rows = parse_csv_rows(text, path)
    if [c.strip() for c in rows[0]] == LOC_HEADER:
        return "loc", parse_loc(rows[1:], lookup, path), None
    header = is_header(rows[0], lookup)
    return "csv", parse_pairs(enumerate(rows[header:], start=1 + header), lookup, path), None


def is_header(row: list[str], lookup: "ClassLookup") -> bool:
    """Whether a CSV's first row is a header: two columns, the first no image's name (the
    split's images all carry an image extension) and the second no class."""
    return (len(row) == 2 and not row[0].strip().lower().endswith(IMAGE_EXTENSIONS)
            and not lookup.knows(row[1]))


def read_bounded(path: str) -> bytes:
    """The file's bytes: a regular file of at most MAX_BYTES, checked on the opened file
    before reading (a FIFO or device could hang or never end; source_io never blocks on one)."""
    try:
        return read_regular_file(path, MAX_BYTES)
    except BadImageError as exc:  # not a regular file, too large, or changed while read
        raise SourceError(f"{path}: cannot read label file ({exc.reason}); is it the right file?", path) from exc
    except OSError as exc:
        raise SourceError(f"{path}: cannot read label file ({exc.strerror or exc})", path) from exc


class ClassLookup:
    """A class value (name, or integer index when no class name is an integer) -> class index."""

    def __init__(self, classes: list[str], path: str):
        self.classes, self.path = classes, path
        self.index = {c: i for i, c in enumerate(classes)}
        self.numeric_names = any(INTEGER.fullmatch(c) for c in classes)

    def knows(self, value: str) -> bool:
        """Whether value names a class (or indexes one), as __call__ would take it."""
        value = value.strip()
        if value in self.index:
            return True
        return not self.numeric_names and bool(INTEGER.fullmatch(value)) and 0 <= int(value) < len(self.classes)

    def __call__(self, value, where: str) -> int:
        if isinstance(value, str):
            value = value.strip()
            if value in self.index:
                return self.index[value]
            if not self.numeric_names and INTEGER.fullmatch(value):
                value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and not self.numeric_names:
            if 0 <= value < len(self.classes):
                return value
            raise SourceError(f"{self.path}: {where}: class index {value} outside 0 to {len(self.classes) - 1} "
                              f"(indexes are 0-based into the {len(self.classes)} sorted class folders)", self.path)
        shown = value if isinstance(value, str) else json.dumps(value)
        raise SourceError(f"{self.path}: {where}: class {shorten(str(shown))!r} is not one of the "
                          f"{len(self.classes)} class folders ({', '.join(self.classes[:5])}"
                          f"{' ...' if len(self.classes) > 5 else ''}); a label file cannot add classes", self.path)


def checked_key(key, path: str, where: str) -> str:
    """A file name or path relative to the split folder, refused if it could lead outside it."""
    if not isinstance(key, str) or not key.strip():
        raise SourceError(f"{path}: {where}: file name missing", path)
    key = key.strip()
    parts = key.replace("\\", "/").split("/")
    if (len(key) > MAX_NAME or CONTROL.search(key) or key.startswith(("/", "\\")) or ".." in parts
            or re.match(r"[A-Za-z]:", key)):
        raise SourceError(f"{path}: {where}: {shorten(key)!r} is not a file name inside the split folder "
                          "(absolute paths, '..' and control characters are refused)", path)
    return "/".join(p for p in parts if p not in ("", "."))


def add_label(labels: dict[str, int], key: str, label: int, path: str, where: str) -> None:
    if key in labels and labels[key] != label:
        raise SourceError(f"{path}: {where}: {key!r} is labeled twice, with different classes", path)
    labels[key] = label


def parse_json(text: str, lookup: ClassLookup, path: str) -> dict[str, int]:
    def pairs(items):
        return items  # keep duplicates, so that they are reported

    try:
        obj = json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as exc:
        raise SourceError(f"{path}: not valid JSON ({shorten(str(exc))}); "
                          'give one object {"filename": "class"}', path) from exc
    if not isinstance(obj, list) or any(not isinstance(p, tuple) for p in obj):
        raise SourceError(f'{path}: JSON label file must be one object {{"filename": "class"}}', path)
    labels: dict[str, int] = {}
    for key, value in obj:
        where = f"entry {shorten(str(key))!r}"
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise SourceError(f"{path}: {where}: class must be a name or an index, not {type(value).__name__}", path)
        add_label(labels, checked_key(key, path, where), lookup(value, where), path, where)
    return labels


def parse_csv_rows(text: str, path: str) -> list[list[str]]:
    try:
        rows = [row for row in csv.reader(io.StringIO(text, newline="")) if any(c.strip() for c in row)]
    except csv.Error as exc:
        raise SourceError(f"{path}: not valid CSV ({exc})", path) from exc
    return rows


def parse_loc(rows: list[list[str]], lookup: ClassLookup, path: str) -> dict[str, int]:
    labels: dict[str, int] = {}
    for number, row in enumerate(rows, start=2):
        where = f"row {number}"
        if len(row) != 2 or not row[1].split():
            raise SourceError(f"{path}: {where}: expected ImageId,PredictionString with a class first", path)
        add_label(labels, checked_key(row[0], path, where), lookup(row[1].split()[0], where), path, where)
    return labels


def parse_pairs(rows, lookup: ClassLookup, path: str) -> dict[str, int]:
    labels: dict[str, int] = {}
    for number, row in rows:
        where = f"row {number}"
        if len(row) != 2:
            raise SourceError(f"{path}: {where}: expected two columns filename,class, found {len(row)}", path)
        add_label(labels, checked_key(row[0], path, where), lookup(row[1], where), path, where)
    return labels


def parse_integers(lines: list[str], classes: list[str], index_base: int | None, path: str) -> list[int]:
    if index_base is None:
        raise SourceError(
            f"{path}: a list of class indexes (such as ILSVRC2012_validation_ground_truth.txt) is only "
            "accepted with --labels-index-base 0|1, stating its indexes are into packer's sorted class "
            "list. ILSVRC's own indexes follow its synset order, not the sorted folder names: for ImageNet "
            "use LOC_val_solution.csv, or a filename,class CSV", path)
    found = [int(line) - index_base for line in lines]
    for line, value in enumerate(found, start=1):
        if not 0 <= value < len(classes):
            raise SourceError(f"{path}: line {line}: class index {value + index_base} outside "
                              f"{index_base} to {len(classes) - 1 + index_base} (base {index_base}, "
                              f"{len(classes)} classes)", path)
    return found


def shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
