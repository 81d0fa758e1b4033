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
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .errors import SourceError
from .records import UNLABELED, PathTable

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLIT_NAMES = ("train", "val", "test")
DEFAULT_SPLIT = "all"


@dataclass
class SplitListing:
    """The files of one split, in ImageFolder order."""

    paths: PathTable  # relative to SRC, "/"-separated
    labels: np.ndarray  # int32, UNLABELED for unlabeled splits
    labeled: bool

    def __len__(self) -> int:
        return len(self.paths)


@dataclass
class Source:
    root: str
    classes: list[str]
    splits: dict[str, SplitListing]
    warnings: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(len(s) for s in self.splits.values())

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def is_image_name(name: str) -> bool:
    return not is_hidden(name) and name.lower().endswith(IMG_EXTENSIONS)


def visible_dirs(folder: str) -> list[str]:
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not is_hidden(e.name))


def visible_images(folder: str) -> list[str]:
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if not e.is_dir() and is_image_name(e.name))


def walk_images(folder: str, warnings: list[str]) -> list[str]:
    """Image files under folder, in sorted(os.walk(folder, followlinks=True)) order."""
    found: list[tuple[str, list[str]]] = []
    seen = {os.path.realpath(folder)}
    for root, dirs, files in os.walk(folder, followlinks=True):
        kept = []
        for d in dirs:
            real = os.path.realpath(os.path.join(root, d))
            if is_hidden(d):
                continue
            if real in seen:  # a symlink cycle would make os.walk recurse forever
                warnings.append(f"{os.path.join(root, d)}: folder already visited (symlink loop), skipped")
                continue
            seen.add(real)
            kept.append(d)
        dirs[:] = kept
        found.append((root, sorted(f for f in files if is_image_name(f))))
    found.sort(key=lambda rf: rf[0])
    return [os.path.join(root, f) for root, files in found for f in files]


def scan_source(src: str | os.PathLike) -> Source:
    """List every image of SRC with its split and label."""
    root = os.path.abspath(os.fspath(src))
    if not os.path.isdir(root):
        raise SourceError(f"{root}: not a folder (SRC must be an ImageFolder tree: SRC/<class>/<images>)", root)
    warnings: list[str] = []
    top = visible_dirs(root)
    split_dirs = [d for d in top if d in SPLIT_NAMES]
    if split_dirs and len(split_dirs) == len(top):
        split_roots = {d: os.path.join(root, d) for d in split_dirs}
    else:
        if split_dirs:
            warnings.append(f"{root}: {', '.join(split_dirs)} treated as class folders, because SRC also "
                            f"holds other folders; put every class inside train/ val/ test/ to pack splits")
        split_roots = {DEFAULT_SPLIT: root}

    class_dirs = {name: visible_dirs(path) for name, path in split_roots.items()}
    classes = sorted(set().union(*class_dirs.values()))
    class_to_idx = {c: i for i, c in enumerate(classes)}
    splits = {}
    for name, path in split_roots.items():
        if class_dirs[name]:
            splits[name] = list_labeled(root, path, class_dirs[name], class_to_idx, warnings)
        else:
            splits[name] = list_unlabeled(root, path)
    source = Source(root, classes, splits, warnings)
    if source.count == 0:
        raise SourceError(f"{root}: no image files found (looked for {', '.join(IMG_EXTENSIONS)} "
                          f"in SRC/<class>/ folders, any letter case)", root)
    return source


def list_labeled(root: str, split_root: str, class_names: list[str], class_to_idx: dict[str, int],
                 warnings: list[str]) -> SplitListing:
    paths: list[str] = []
    labels: list[int] = []
    for cls in class_names:
        files = walk_images(os.path.join(split_root, cls), warnings)
        if not files:
            warnings.append(f"{os.path.relpath(os.path.join(split_root, cls), root)}: empty class folder; "
                            f"label {class_to_idx[cls]} kept with 0 samples")
        paths += [relative(root, f) for f in files]
        labels += [class_to_idx[cls]] * len(files)
    loose = visible_images(split_root)
    if loose:
        warnings.append(f"{relative(root, split_root) or '.'}: {len(loose)} image(s) beside the class folders "
                        "ignored, as ImageFolder does (move them into a class folder to pack them)")
    return SplitListing(PathTable.from_strings(paths), np.asarray(labels, dtype=np.int32), True)


def list_unlabeled(root: str, split_root: str) -> SplitListing:
    paths = [relative(root, os.path.join(split_root, f)) for f in visible_images(split_root)]
    return SplitListing(PathTable.from_strings(paths), np.full(len(paths), UNLABELED, np.int32), False)


def relative(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)
    return "" if rel == "." else rel.replace(os.sep, "/")
