"""Finds the images of a source folder and their labels, exactly as torchvision's ImageFolder does.

Layouts, decided from SRC's top level:
  SRC/<class>/**/<file>                 one split, named "all"
  SRC/{train,val,test}/<class>/**/<file> one split per folder, one shared class list
  SRC/<file> (no sub-folders)            unlabeled (label -1); also per split folder

Labels are indexes into the sorted class-folder names; files are found recursively under
each class folder in sorted(os.walk(...)) order with ImageFolder's extensions, matched
case-insensitively, following symlinked folders. Two deliberate differences: names that
start with "." are ignored (macOS "._x.JPEG" forks, ".ipynb_checkpoints"), and an empty
class folder keeps its label instead of aborting, so labels never shift.

Nothing is lost silently: a folder that cannot be read (permission denied) stops the scan
with SourceError, or with on_error="skip" is left out and listed in Source.skipped. Image
files that are not regular files (FIFO, socket, device) stay in the listing, marked as
refused, so that packing applies its on_error policy to them without ever opening them.
"""
from __future__ import annotations

import errno
import functools
import mmap
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from .check import IMAGE_EXTENSIONS
from .errors import PackError, SourceError
from .formats._tables import drop_pages, spilled_array
from .labels import LabelFile, read_label_file
from .records import UNLABELED, PathTable, encode_path
from .source_io import not_regular_reason

SPLIT_NAMES = ("train", "val", "test")
DEFAULT_SPLIT = "all"
ON_ERROR = ("fail", "skip")


@dataclass
class SplitListing:
    """The files of one split, in ImageFolder order."""

    paths: PathTable  # relative to SRC, "/"-separated
    labels: np.ndarray  # int32, UNLABELED for unlabeled splits
    labeled: bool
    # Listing index -> why that file is refused without being opened (a FIFO, a device):
    # kept in the listing, so that the on_error policy treats it like any other bad file.
    refused: dict[int, str] = field(default_factory=dict)
    # Where its tables were spilled (scan_source's spill_dir), for tables derived from them.
    spill_dir: str | None = None

    def __len__(self) -> int:
        return len(self.paths)


@dataclass
class Source:
    root: str
    classes: list[str]
    splits: dict[str, SplitListing]
    warnings: list[str] = field(default_factory=list)
    # Folders left out because they cannot be read (on_error="skip"), as metadata "skipped" entries.
    skipped: list[dict] = field(default_factory=list)
    labels: LabelFile | None = None  # the label file applied to the flat splits, if any

    @property
    def count(self) -> int:
        return sum(len(s) for s in self.splits.values())

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def is_image_name(name: str) -> bool:
    return not is_hidden(name) and name.lower().endswith(IMAGE_EXTENSIONS)


def is_folder(entry: os.DirEntry) -> bool:
    """Whether entry is a folder, following symlinks as ImageFolder does."""
    try:
        return entry.is_dir()
    except OSError:  # a symlink into a folder we may not search: listed as a file, reported when read
        return False


def refusal(entry: os.DirEntry) -> str | None:
    """Why the file entry must not be opened (FIFO, socket, device), or None.

    Free for a regular file (the entry's type comes from the directory listing); one stat
    for a symlink. A file that cannot be stat'ed is not refused here: reading it reports why.
    """
    try:
        if entry.is_file():
            return None
        return not_regular_reason(entry.stat().st_mode)
    except OSError:
        return None


class HiddenNames:
    """Names starting with "." that a scan left out where ImageFolder would have read them
    (a folder: a class; a file with an image extension: an image), counted, the first
    few kept to name in one warning."""

    SHOWN = 3

    def __init__(self):
        self.count, self.examples = 0, []

    def add(self, path: str) -> None:
        self.count += 1
        if len(self.examples) < self.SHOWN:
            self.examples.append(path)

    def warning(self, root: str) -> str | None:
        if not self.count:
            return None
        named = ", ".join(relative(root, path) for path in self.examples)
        more = f" and {self.count - len(self.examples)} more" if self.count > len(self.examples) else ""
        return (f"{self.count} hidden name(s) left out: {named}{more}; names starting with '.' are never "
                "packed (ImageFolder would read a hidden folder as a class and a hidden image file as an "
                "image); rename one without the leading '.' to pack it")


def list_folder(folder: str, hidden: HiddenNames | None = None) -> tuple[list[str], list[tuple[str, str | None]]]:
    """folder's sub-folder names and its (image file name, refusal) pairs, each sorted by name.

    Hidden names are left out (and counted in hidden, where ImageFolder would read them).
    Raises OSError when folder cannot be read.
    """
    dirs, images, left_out = [], [], []
    with os.scandir(folder) as entries:
        for entry in entries:
            if is_hidden(entry.name):
                if hidden is not None and (entry.name.lower().endswith(IMAGE_EXTENSIONS) or is_folder(entry)):
                    left_out.append(entry.name)
                continue
            if is_folder(entry):
                dirs.append(entry.name)
            elif is_image_name(entry.name):
                images.append((entry.name, refusal(entry)))
    dirs.sort()
    images.sort()
    for name in sorted(left_out):
        hidden.add(os.path.join(folder, name))
    return dirs, images


def folder_advice(exc: OSError) -> str:
    """What to do about a folder that cannot be listed, by why."""
    if exc.errno == errno.ENAMETOOLONG:
        return "its path is longer than the system allows: rename or move folders to shorten it"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "fix its permissions"
    return "see what the system said"


class Scanner:
    """Lists the folders of one SRC, applying the on_error policy to those it cannot read."""

    def __init__(self, root: str, on_error: str):
        self.root, self.on_error = root, on_error
        self.warnings: list[str] = []
        self.skipped: list[dict] = []
        self.hidden = HiddenNames()

    def list_or_skip(self, folder: str, split: str) -> tuple[list[str], list[tuple[str, str | None]]] | None:
        """list_folder(folder), or None when it cannot be read and on_error is skip."""
        try:
            return list_folder(folder, self.hidden)
        except OSError as exc:
            reason = f"cannot read folder ({exc.strerror or exc})"
            rel = relative(self.root, folder)
            if self.on_error == "fail":
                raise SourceError(f"{rel}: {reason}; {folder_advice(exc)}, or pass --on-error skip to leave "
                                  "it out", folder) from exc
            self.skipped.append({"path": rel, "split": split, "reason": reason})
            return None

    def walk_images(self, folder: str, split: str) -> list[tuple[str, str | None]]:
        """(path, refusal) of the image files under folder, in sorted(os.walk(folder, followlinks=True)) order."""
        found: list[tuple[str, list[tuple[str, str | None]]]] = []
        # Each folder with the real paths of the folders above it: a link back to one of them
        # is a cycle, which would make the walk recurse forever. Two links to one folder are
        # not: os.walk (and so ImageFolder) lists its images under both names.
        stack = [(folder, frozenset([os.path.realpath(folder)]))]
        while stack:
            top, above = stack.pop()
            listed = self.list_or_skip(top, split)
            if listed is None:
                continue
            dirs, images = listed
            children = []
            for name in dirs:
                path = os.path.join(top, name)
                real = os.path.realpath(path)
                if real in above:
                    self.warnings.append(f"{path}: a link to a folder above it (symlink loop), skipped")
                    continue
                children.append((path, above | {real}))
            stack += reversed(children)  # depth first, in name order, as os.walk visits them
            found.append((top, images))
        found.sort(key=lambda rf: rf[0])
        return [(os.path.join(top, name), why) for top, images in found for name, why in images]


def scan_source(src: str | os.PathLike, on_error: str = "fail", labels: LabelFile | None = None,
                labels_index_base: int | None = None, spill_dir: str | None = None) -> Source:
    """List every image of SRC with its split and label.

    on_error decides what a folder that cannot be read does: "fail" raises SourceError,
    "skip" leaves it out and lists it in Source.skipped. labels, a label file's path (or a
    parsed LabelFile), labels the flat splits (packer.labels); a file it gives no label
    follows on_error too. spill_dir: keep the labeled splits' paths in unlinked files in
    that folder, mapped, rather than in memory (PathBlob; pack puts them beside OUT).
    """
    if on_error not in ON_ERROR:
        raise PackError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
    root = os.path.abspath(os.fspath(src))
    if not os.path.isdir(root):
        raise SourceError(f"{root}: not a folder (SRC must be an ImageFolder tree: SRC/<class>/<images>)", root)
    scan = Scanner(root, on_error)
    try:
        top = list_folder(root, scan.hidden)
    except OSError as exc:
        raise SourceError(f"{root}: cannot read folder ({exc.strerror or exc}); {folder_advice(exc)}", root) from exc
    split_dirs = [d for d in top[0] if d in SPLIT_NAMES]
    if split_dirs and len(split_dirs) == len(top[0]):
        split_roots = {d: os.path.join(root, d) for d in split_dirs}
        listed = {d: scan.list_or_skip(path, d) for d, path in split_roots.items()}
    else:
        if split_dirs:
            scan.warnings.append(f"{root}: {', '.join(split_dirs)} treated as class folders, because SRC also "
                                 f"holds other folders; put every class inside train/ val/ test/ to pack splits")
        split_roots = {DEFAULT_SPLIT: root}
        listed = {DEFAULT_SPLIT: top}
    listed = {name: folder for name, folder in listed.items() if folder is not None}

    classes = sorted(set().union(*(dirs for dirs, _ in listed.values())))
    class_to_idx = {c: i for i, c in enumerate(classes)}
    splits = {}
    for name, (class_names, images) in listed.items():
        if class_names:
            splits[name] = list_labeled(scan, name, split_roots[name], class_names, class_to_idx, len(images),
                                         spill_dir)
        else:
            splits[name] = list_unlabeled(root, split_roots[name], images)
    if labels is not None:
        if not isinstance(labels, LabelFile):
            labels = read_label_file(labels, classes, labels_index_base,
                                     functools.partial(label_names, root, splits, split_roots))
        apply_labels(scan, splits, split_roots, labels)
    warn_unlabeled(scan, splits, split_roots)
    hidden = scan.hidden.warning(root)
    if hidden is not None:
        scan.warnings.append(hidden)
    source = Source(root, classes, splits, scan.warnings, scan.skipped, labels)
    if source.count == 0:
        raise SourceError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)} "
                          f"in SRC/<class>/ folders, any letter case)", root)
    return source


def list_labeled(scan: Scanner, split: str, split_root: str, class_names: list[str],
                 class_to_idx: dict[str, int], loose: int, spill_dir: str | None = None) -> SplitListing:
    """The images of each class folder; `loose` images beside them are ignored, as ImageFolder does.

    Streams: one class's file names are Python strings at a time; the split keeps its paths
    as one NUL-joined blob (with spill_dir, in an unlinked file there, mapped: PathBlob)
    plus offsets, and its labels as one array, so a million-file split never holds a
    million Python objects, nor with spill_dir its paths' bytes."""
    root = scan.root
    blob = PathBlob(spill_dir)
    counts: list[int] = []
    refused: dict[int, str] = {}
    listed = 0
    for cls in class_names:
        folder = os.path.join(split_root, cls)
        skipped_before = len(scan.skipped)
        files = scan.walk_images(folder, split)
        if not files and len(scan.skipped) == skipped_before:
            scan.warnings.append(f"{relative(root, folder)}: empty class folder; "
                                 f"label {class_to_idx[cls]} kept with 0 samples")
        for k, (_, why) in enumerate(files):
            if why is not None:
                refused[listed + k] = why
        blob.extend([encode_path(relative_below(root, path)) for path, _ in files])
        counts.append(len(files))
        listed += len(files)
    if loose:
        scan.warnings.append(f"{relative(root, split_root) or '.'}: {loose} image(s) beside the class "
                             "folders ignored, as ImageFolder does (move them into a class folder to pack them)")
    labels = np.repeat(np.array([class_to_idx[c] for c in class_names], np.int32), counts)
    return SplitListing(blob.table(), spilled_array(labels, spill_dir), True, refused, spill_dir)


class PathBlob:
    """A split's paths as they are listed, joined by NUL: in memory, or with folder given
    appended to an unlinked file there (nothing is left behind if the process dies) and
    mapped read-only once listed. A mapped table's pages are the page cache's: its holder
    drops the ones it has read (packer.formats._tables.drop_pages) to keep them out of its RSS."""

    def __init__(self, folder: str | None):
        self.folder, self.file = folder, None
        if folder is not None:
            try:
                self.file = tempfile.TemporaryFile(dir=folder)
            except OSError:  # a folder we cannot write to (pack then says so, clearly): kept in memory
                self.folder = None
        self.pieces: list[bytes] = []
        self.ends: list[np.ndarray] = []  # per batch: where each path ends, NUL included
        self.size = 0

    def extend(self, names: list[bytes]) -> None:
        if not names:
            return
        piece = b"\0".join(names) + b"\0"
        ends = self.size + np.cumsum(np.fromiter(map(len, names), np.int64, len(names)) + 1)
        self.ends.append(ends)
        self.append(piece)

    def append(self, piece: bytes) -> None:
        if self.file is None:
            self.pieces.append(piece)
        else:
            try:
                self.file.write(piece)
            except OSError as exc:
                raise self.spill_error(exc) from exc
        self.size += len(piece)

    def extend_table(self, table: PathTable) -> None:
        """Append the paths of a PathTable."""
        if not len(table):
            return
        self.ends.append(self.size + (table.offsets[1:].astype(np.int64) - table.offsets.item(0)))
        self.append(table.to_nul_separated() + b"\0")

    def spill_error(self, exc: OSError) -> PackError:
        """The error for a failed write of the spill file (a full disk, most likely)."""
        return PackError(f"{self.folder}: cannot write the list of source paths packer keeps there while it packs "
                         f"({exc.strerror or exc}); free some space there or choose -o elsewhere (nothing was "
                         "written at OUT)", self.folder)

    def table(self) -> PathTable:
        dtype = np.uint32 if self.size < 2**32 else np.int64
        offsets = np.concatenate([np.zeros(1, dtype)] + [e.astype(dtype) for e in self.ends])
        self.ends = []
        if self.file is not None:
            offsets = spilled_array(offsets, self.folder)
        # The data ends at the last path, without its NUL: the on-disk form, as before.
        if self.file is None or not self.size:
            data = b"".join(self.pieces)[:-1]
        else:
            try:
                self.file.flush()
            except OSError as exc:
                raise self.spill_error(exc) from exc
            data = mmap.mmap(self.file.fileno(), self.size - 1, access=mmap.ACCESS_READ)
        if self.file is not None:
            self.file.close()  # the map keeps the (nameless) file alive
        self.pieces = []
        return PathTable(data, offsets)


def kept_paths(paths: PathTable, kept: np.ndarray, folder: str | None, block: int = 1 << 16) -> PathTable:
    """The paths where kept (a bool per path) is true: paths itself when all are, else a new
    table built a block of paths at a time (spilled to folder, if given, as scan_source's)."""
    if kept.all():
        return paths
    blob = PathBlob(folder)
    offsets = paths.offsets
    for start in range(0, len(paths), block):
        stop = min(len(paths), start + block)
        low = offsets.item(start)
        part = PathTable(paths.data[low:offsets.item(stop)], offsets[start:stop + 1].astype(np.int64) - low)
        blob.extend_table(part.subset(kept[start:stop]))
        drop_pages(paths.data)
    return blob.table()


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """'1 image', '2 images'; '1 class', '3 classes' (nouns: the plural, where not noun + s)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def list_unlabeled(root: str, split_root: str, images: list[tuple[str, str | None]]) -> SplitListing:
    paths = [relative(root, os.path.join(split_root, name)) for name, _ in images]
    refused = {i: why for i, (_, why) in enumerate(images) if why is not None}
    return SplitListing(PathTable.from_strings(paths), np.full(len(paths), UNLABELED, np.int32), False, refused)


def warn_unlabeled(scan: Scanner, splits: dict[str, SplitListing], split_roots: dict[str, str]) -> None:
    """A flat split beside labeled ones is almost always a validation set whose labels live in a file;
    images with no class folder anywhere are most often one class's folder given as SRC."""
    if not any(s.labeled for s in splits.values()):
        for name, listing in splits.items():
            if len(listing):
                scan.warnings.append(
                    f"{split_roots[name]}: {plural(len(listing), 'image')} and no class folders, packed unlabeled (label -1). packer expects ImageFolder's layout, "
                    "SRC/<class>/<image> (or SRC/train/<class>/<image>, SRC/val/<class>/<image>): if this is one "
                    "class's folder, pack the folder above it; to label flat images, pass --labels FILE")
        return
    for name, listing in splits.items():
        if not listing.labeled and len(listing):
            folder = relative(scan.root, split_roots[name]) or "."
            scan.warnings.append(f"{folder}/: {len(listing)} images with no class folders, packed unlabeled "
                                 "(label -1); pass --labels FILE to label them")


def apply_labels(scan: Scanner, splits: dict[str, SplitListing], split_roots: dict[str, str],
                 labels: LabelFile) -> None:
    """Label the flat splits from labels, in place: every flat split it names a file of (an
    integer list: the one flat split). A file it gives no label stops the scan, or with
    on_error skip is left out and listed in scan.skipped; names of no file are reported."""
    flat = {name: s for name, s in splits.items() if not s.labeled}
    if not flat:
        raise SourceError(f"{labels.path}: --labels given, but every split of {scan.root} has class folders; "
                          "labels apply only to a flat split (images with no class folders)", scan.root)
    if labels.by_position is not None:
        found = positional_labels(flat, labels, split_roots, scan.root)
    else:
        found = keyed_labels(scan, flat, labels, split_roots)
    for name, values in found.items():
        splits[name] = labeled_listing(scan, name, flat[name], values, labels.name)


def positional_labels(flat: dict[str, SplitListing], labels: LabelFile, split_roots: dict[str, str],
                      root: str) -> dict[str, np.ndarray]:
    if len(flat) != 1:
        raise SourceError(f"{labels.path}: a list of class indexes cannot say which of the flat splits "
                          f"{', '.join(sorted(flat))} it labels; give a filename,class CSV instead", root)
    (name, listing), = flat.items()
    if len(labels.by_position) != len(listing):
        raise SourceError(f"{labels.path}: {len(labels.by_position)} class indexes for the {len(listing)} "
                          f"images of {relative(root, split_roots[name]) or '.'}/; it must give one per "
                          "image, in sorted file-name order", root)
    return {name: np.asarray(labels.by_position, dtype=np.int32)}


def label_keys(root: str, split_root: str, relpath: str, stems: bool) -> tuple[str, str]:
    """The names a label file may give a file by: its path in the split folder, and in SRC."""
    in_split = os.path.relpath(os.path.join(root, relpath), split_root).replace(os.sep, "/")
    if stems:
        return os.path.splitext(in_split)[0], os.path.splitext(relpath)[0]
    return in_split, relpath


def label_names(root: str, splits: dict[str, SplitListing], split_roots: dict[str, str], stems: bool) -> set[str]:
    """Every name a label file may give an image of the flat splits by (label_keys): what
    read_label_file keeps entries of, so that its memory follows the images, not the file."""
    return {key for name, listing in splits.items() if not listing.labeled
            for relpath in listing.paths for key in label_keys(root, split_roots[name], relpath, stems)}


def keyed_labels(scan: Scanner, flat: dict[str, SplitListing], labels: LabelFile,
                 split_roots: dict[str, str]) -> dict[str, np.ndarray]:
    found, used = {}, set()
    for name, listing in flat.items():
        values = np.full(len(listing), UNLABELED, np.int32)
        for i, relpath in enumerate(listing.paths):
            for key in label_keys(scan.root, split_roots[name], relpath, labels.keys_are_stems):
                if key in labels.by_key:
                    values[i] = labels.by_key[key]
                    used.add(key)
                    break
        if (values != UNLABELED).any():
            found[name] = values
    if not found:
        sample = ", ".join((sorted(labels.by_key) + labels.unmatched_names)[:3])
        raise SourceError(f"{labels.path}: names none of the images of the flat split(s) "
                          f"{', '.join(sorted(flat))} (it names e.g. {sample}); is it the right file?", scan.root)
    unknown = labels.unmatched_names + sorted(labels.by_key.keys() - used)
    if unknown:
        scan.warnings.append(f"{labels.name}: {labels.unmatched + len(unknown) - len(labels.unmatched_names)} "
                             "name(s) match no image of the split "
                             f"(first: {', '.join(unknown[:5])}); they were ignored")
    return found


def labeled_listing(scan: Scanner, split: str, listing: SplitListing, values: np.ndarray,
                    label_file: str) -> SplitListing:
    missing = np.flatnonzero(values == UNLABELED)
    if len(missing) and scan.on_error == "fail":
        raise SourceError(f"{listing.paths[int(missing[0])]}: no label in {label_file} ({len(missing)} image(s) "
                          "of the split have none); add them to it, or pass --on-error skip to leave them out",
                          scan.root)
    reason = f"no label in {label_file}"
    scan.skipped += [{"path": listing.paths[int(i)], "split": split, "reason": reason} for i in missing]
    keep = values != UNLABELED
    new_index = np.cumsum(keep) - 1
    refused = {int(new_index[i]): why for i, why in listing.refused.items() if keep[i]}
    return SplitListing(listing.paths.subset(keep), values[keep], True, refused)


def relative_below(root: str, path: str) -> str:
    """relative() for a path built by joining names onto root: a slice, not a relpath call."""
    if path.startswith(root) and path[len(root):len(root) + 1] == os.sep:
        rel = path[len(root) + 1:]
        return rel if os.sep == "/" else rel.replace(os.sep, "/")
    return relative(root, path)


def relative(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)
    return "" if rel == "." else rel.replace(os.sep, "/")
