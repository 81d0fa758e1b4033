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

import array
import codecs
import csv
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Container, Iterable, Iterator, Sequence

from .check import IMAGE_EXTENSIONS
from .errors import BadImageError, SourceError
from .source_io import open_regular_file

MAX_BYTES = 512 * 1024 * 1024  # ImageNet's LOC_val_solution.csv is about 2 MB
MAX_NAME = 4096
CHUNK = 1 << 20  # bytes read and parsed at a time
MAX_TOKEN = 1 << 20  # characters of one JSON key or value (names are at most MAX_NAME)
INDEX_BASES = (0, 1)
LOC_HEADER = ["ImageId", "PredictionString"]
INTEGER = re.compile(r"[+-]?[0-9]{1,9}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
DRIVE = re.compile(r"[A-Za-z]:")
# A name of one component, no leading dot, no "..", no control character, "/", "\\" or ":":
# checked_key keeps it as it is.
PLAIN_NAME = re.compile(r"[\w\-+ ]+(?:\.[\w\-+ ]+)*")


@dataclass
class LabelFile:
    """A parsed label file: class index per key, or per sorted position (by_position)."""

    name: str  # the file's base name, as recorded in the metadata
    sha256: str
    shape: str  # "loc", "csv", "json" or "integers"
    by_key: dict[str, int]  # key (file name, path in the split, or stem for "loc") -> class index
    by_position: Sequence[int] | None = None  # "integers": class index of each file in sorted order
    path: str = ""  # where it was read from, for messages
    unmatched: int = 0  # entries naming no image of the split (read with wanted): checked, not kept
    unmatched_names: list[str] = field(default_factory=list)  # the first few of them

    @property
    def keys_are_stems(self) -> bool:
        return self.shape == "loc"

    def params(self) -> dict:
        return {"file": self.name, "sha256": self.sha256, "shape": self.shape}


def read_label_file(path: str | os.PathLike, classes: list[str], index_base: int | None = None,
                    wanted: Callable[[bool], Container[str]] | None = None) -> LabelFile:
    """Parse the label file at path against the class list (see the module docstring).

    wanted(stems): the names the file may give the images it labels (stems: without their
    extension, as the LOC shape names them). Every entry is checked, and only those naming
    a wanted image are kept (the others are counted, with the first few names).

    The file is read and parsed as a stream, CHUNK bytes at a time: memory holds one chunk
    and the labels kept, never the whole text, its lines or its rows, so with wanted it is
    bounded by the images labelled, whatever the file holds. A list of class indexes is
    kept whole, 4 bytes an entry (its lines are at least 2 bytes)."""
    path = os.fspath(path)
    if index_base is not None and index_base not in INDEX_BASES:
        raise SourceError(f"labels index base must be 0 or 1, not {index_base!r}", path)
    lookup = ClassLookup(classes, path)
    fd, size = open_bounded(path)
    try:
        digest = hashlib.sha256()
        shape, kept, by_position = parse_shape(text_chunks(fd, size, digest, path), lookup, classes, index_base,
                                               wanted, path)
    finally:
        os.close(fd)
    if index_base is not None and shape != "integers":
        raise SourceError(f"{path}: --labels-index-base applies to a list of class indexes, and this is a "
                          f"{shape} label file: leave it out", path)
    return LabelFile(os.path.basename(path), digest.hexdigest(), shape, kept.by_key, by_position, path,
                     kept.unmatched, kept.unmatched_names)


def parse_shape(chunks: Iterator[str], lookup: "ClassLookup", classes: list[str], index_base: int | None,
                wanted: Callable[[bool], Container[str]] | None, path: str) -> tuple:
    """(shape, the Kept labels, by_position) of the label file's text, given as chunks (read to its end)."""
    head = ""
    for chunk in chunks:
        head = chunk.lstrip()
        if head:
            break
    if not head:
        raise SourceError(f"{path}: label file is empty", path)
    text = itertools.chain([head], chunks)
    if head[0] == "[":
        raise SourceError(f'{path}: JSON label file must be one object {{"filename": "class"}}', path)
    if head[0] == "{":
        return "json", parse_json(text, lookup, Kept(wanted and wanted(False), path)), None
    lines = (line for line in text_lines(text) if line.strip())
    first = next(lines)
    lines = itertools.chain([first], lines)
    if INTEGER.fullmatch(first.strip()):
        return "integers", Kept(None, path), parse_integers(lines, classes, index_base, path)
    rows = csv_rows(lines, path)
    header = next(rows, [])
    if [c.strip() for c in header] == LOC_HEADER:
        return "loc", parse_loc(rows, lookup, Kept(wanted and wanted(True), path)), None
    named = is_header(header, lookup)
    body = rows if named else itertools.chain([header], rows)
    return "csv", parse_pairs(enumerate(body, start=1 + named), lookup, Kept(wanted and wanted(False), path)), None


def is_header(row: list[str], lookup: "ClassLookup") -> bool:
    """Whether a CSV's first row is a header: two columns, the first no image's name (the
    split's images all carry an image extension) and the second no class."""
    return (len(row) == 2 and not row[0].strip().lower().endswith(IMAGE_EXTENSIONS)
            and not lookup.knows(row[1]))


def open_bounded(path: str) -> tuple[int, int]:
    """(descriptor, size) of the label file: a regular file of at most MAX_BYTES, checked on
    the opened file before reading (a FIFO or device could hang or never end; source_io
    never blocks on one)."""
    try:
        return open_regular_file(path, MAX_BYTES)
    except BadImageError as exc:  # not a regular file, or too large
        raise SourceError(f"{path}: cannot read label file ({exc.reason}); is it the right file?", path) from exc
    except OSError as exc:
        raise SourceError(f"{path}: cannot read label file ({exc.strerror or exc})", path) from exc


def text_chunks(fd: int, size: int, digest, path: str) -> Iterator[str]:
    """The file's text, CHUNK bytes at a time, decoded as UTF-8 (a BOM dropped) and hashed
    into digest as it is read; NUL bytes, bad UTF-8 and a file changing size are refused."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    done = 0
    while True:
        try:
            data = os.read(fd, CHUNK)
        except OSError as exc:
            raise SourceError(f"{path}: cannot read label file ({exc.strerror or exc})", path) from exc
        digest.update(data)
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            raise SourceError(f"{path}: label file is not UTF-8 text (byte {done + exc.start}); "
                              "give a CSV, JSON or text file", path) from exc
        done += len(data)
        if "\x00" in text:
            raise SourceError(f"{path}: label file holds NUL bytes (binary?); give a CSV, JSON or text file", path)
        if not data or done > size:
            break
        yield text
    if done != size:
        raise SourceError(f"{path}: label file changed while being read ({size} bytes when opened, then "
                          f"{done}); make sure nothing is writing to it", path)


def text_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The lines of the text given as chunks, with their line endings (where str.splitlines
    splits; a "\r\n" cut between two chunks stays one ending)."""
    rest = ""
    for chunk in chunks:
        lines = (rest + chunk).splitlines(keepends=True)
        rest = lines.pop() if lines and not lines[-1].endswith("\n") else ""
        yield from lines
    if rest:
        yield rest


class ClassLookup:
    """A class value (name, or integer index when no class name is an integer) -> class index."""

    def __init__(self, classes: list[str], path: str):
        self.classes, self.path = classes, path
        self.index = {c: i for i, c in enumerate(classes)}
        self.numeric_names = any(INTEGER.fullmatch(c) for c in classes)

    def knows(self, value: str) -> bool:
        """Whether value names a class (or indexes one): whether __call__ takes it."""
        try:
            self(value, "")
        except SourceError:
            return False
        return True

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
    if len(key) <= MAX_NAME and PLAIN_NAME.fullmatch(key):  # most rows: the checks below cannot refuse it
        return key
    parts = key.replace("\\", "/").split("/")
    if (len(key) > MAX_NAME or CONTROL.search(key) or key.startswith(("/", "\\")) or ".." in parts
            or DRIVE.match(key)):
        raise SourceError(f"{path}: {where}: {shorten(key)!r} is not a file name inside the split folder "
                          "(absolute paths, '..' and control characters are refused)", path)
    return "/".join(p for p in parts if p not in ("", "."))


class Kept:
    """The labels kept from a label file: those of wanted names (every one without wanted)."""

    def __init__(self, wanted: Container[str] | None, path: str):
        self.wanted, self.path = wanted, path
        self.by_key: dict[str, int] = {}
        self.unmatched = 0
        self.unmatched_names: list[str] = []

    def add(self, key: str, label: int, where: str) -> None:
        if self.wanted is not None and key not in self.wanted:
            self.unmatched += 1
            if len(self.unmatched_names) < 5:
                self.unmatched_names.append(key)
            return
        if key in self.by_key and self.by_key[key] != label:
            raise SourceError(f"{self.path}: {where}: {key!r} is labeled twice, with different classes", self.path)
        self.by_key[key] = label


def parse_json(text: Iterator[str], lookup: ClassLookup, kept: Kept) -> Kept:
    path = kept.path
    for key, value in JsonPairs(text, path):
        where = f"entry {shorten(str(key))!r}"
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise SourceError(f"{path}: {where}: class must be a name or an index, not {type(value).__name__}", path)
        kept.add(checked_key(key, path, where), lookup(value, where), where)
    return kept


class JsonPairs:
    """The (key, value) pairs of one JSON object, parsed from text given as chunks by the
    json module's own scanners, run on a window of the text that holds the next token.
    Every pair comes through, duplicates too, so that they are reported."""

    WHITESPACE = re.compile(r"[ \t\n\r]*")
    decoder = json.JSONDecoder(object_pairs_hook=list)  # an object as a value shows as a list, as it did

    def __init__(self, chunks: Iterator[str], path: str):
        self.chunks, self.path = chunks, path
        self.text, self.at, self.dropped, self.ended = "", 0, 0, False

    def __iter__(self) -> Iterator[tuple[str, object]]:
        self.expect("{")
        if self.peek() == "}":
            self.at += 1
        else:
            while True:
                key = self.token(self.scan_key)
                self.expect(":")
                yield key, self.token(self.decoder.raw_decode)
                if self.peek() == "}":
                    self.at += 1
                    break
                self.expect(",")
        if self.peek():
            raise self.invalid("Extra data")

    def more(self) -> bool:
        """Add the next chunk to the window, dropping what was parsed; False at the end."""
        chunk = next(self.chunks, None)
        if chunk is None:
            self.ended = True
            return False
        self.dropped += self.at
        self.text, self.at = self.text[self.at:] + chunk, 0
        return True

    def peek(self) -> str:
        """The next character past whitespace ("" at the end of the text)."""
        while True:
            self.at = self.WHITESPACE.match(self.text, self.at).end()
            if self.at < len(self.text) or not self.more():
                return self.text[self.at:self.at + 1]

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise self.invalid(f"Expecting {char!r}")
        self.at += 1

    @staticmethod
    def scan_key(text: str, at: int) -> tuple[str, int]:
        if text[at:at + 1] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
        return json.decoder.scanstring(text, at + 1)

    def token(self, scan) -> object:
        """What scan(text, at) finds next, the window grown until it holds all of it (a
        number or string cut at the window's end scans short, or fails)."""
        self.peek()
        while True:
            try:
                value, end = scan(self.text, self.at)
                if end < len(self.text) or self.ended:
                    self.at = end
                    return value
            except (ValueError, RecursionError) as exc:
                if self.ended:
                    raise self.invalid(getattr(exc, "msg", None) or type(exc).__name__) from exc
            if len(self.text) - self.at > MAX_TOKEN:
                raise self.invalid(f"a key or value over {MAX_TOKEN} characters")
            self.more()

    def invalid(self, reason: str) -> SourceError:
        return SourceError(f"{self.path}: not valid JSON ({shorten(reason)} at character {self.dropped + self.at}); "
                           'give one object {"filename": "class"}', self.path)


def csv_rows(lines: Iterator[str], path: str) -> Iterator[list[str]]:
    """The CSV rows of the lines, less rows with nothing in them."""
    try:
        for row in csv.reader(lines):
            if any(c.strip() for c in row):
                yield row
    except csv.Error as exc:
        raise SourceError(f"{path}: not valid CSV ({exc})", path) from exc


def parse_loc(rows: Iterable[list[str]], lookup: ClassLookup, kept: Kept) -> Kept:
    path = kept.path
    for number, row in enumerate(rows, start=2):
        where = f"row {number}"
        if len(row) != 2 or not row[1].split():
            raise SourceError(f"{path}: {where}: expected ImageId,PredictionString with a class first", path)
        kept.add(checked_key(row[0], path, where), lookup(row[1].split()[0], where), where)
    return kept


def parse_pairs(rows: Iterable[tuple[int, list[str]]], lookup: ClassLookup, kept: Kept) -> Kept:
    path = kept.path
    for number, row in rows:
        where = f"row {number}"
        if len(row) != 2:
            raise SourceError(f"{path}: {where}: expected two columns filename,class, found {len(row)}", path)
        kept.add(checked_key(row[0], path, where), lookup(row[1], where), where)
    return kept


def parse_integers(lines: Iterator[str], classes: list[str], index_base: int | None, path: str) -> array.array:
    if index_base is None:
        raise SourceError(
            f"{path}: a list of class indexes (such as ILSVRC2012_validation_ground_truth.txt) is only "
            "accepted with --labels-index-base 0|1, stating its indexes are into packer's sorted class "
            "list. ILSVRC's own indexes follow its synset order, not the sorted folder names: for ImageNet "
            "use LOC_val_solution.csv, or a filename,class CSV", path)
    found = array.array("i")  # 4 bytes an entry (a list of ints took 8 and more)
    for line, text in enumerate(lines, start=1):
        if not INTEGER.fullmatch(text.strip()):
            raise SourceError(f"{path}: line {line}: {shorten(text.strip())!r} is not a class index, as the lines "
                              "before it are: give one class index per line, or a filename,class CSV", path)
        value = int(text) - index_base
        if not 0 <= value < len(classes):
            raise SourceError(f"{path}: line {line}: class index {value + index_base} outside "
                              f"{index_base} to {len(classes) - 1 + index_base} (base {index_base}, "
                              f"{len(classes)} classes)", path)
        found.append(value)
    return found


def shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
