"""Owns what `--force` may replace: a dataset packer provably wrote, and nothing else.

A look-alike is not enough: a folder that happens to hold a `data.mdb` or an `index.json`,
or any HDF5 file (a model saved with h5py or Keras), holds a user's work. So OUT is
replaceable only when
  - its metadata reads back checked: it parses field by field (packer.records), it carries
    its "crc32" and that matches (packs from before metadata checksums do not, and are
    refused: remove one yourself), and its "format" is the container found;
  - it holds nothing packer did not write: an LMDB folder only `data.mdb` (and the
    `lock.mdb` any LMDB tool adds when it opens one with locking), a WDS folder only
    `index.json` and the files its index names, an HDF5 file only packer's attributes and
    one group per split holding packer's tables.
Anything else is refused by name, saying what was found there. The format is found by its
Format's entry file or signature, and what it holds beyond its own files by its Format's
foreign(). packer.upload asks the same of a dataset at a URL, from its listing.
"""
from __future__ import annotations

import os
import stat
from typing import Callable

import lmdb

from .errors import OutputExistsError, PackError
from .formats import FORMATS, Format
from .formats._foreign import listing, unexpected  # noqa: F401 (packer.upload words its refusals with them)
from .records import Metadata


def refuse_existing(out: str, exists: bool, force: bool, problem_of: Callable[[], str | None], others: str,
                    notes: list[str] = ()) -> None:
    """Refuse an existing OUT without force, and with force anything but a dataset packer wrote:
    problem_of() says what keeps it from being one (problem, or a store's own), others names
    what else an OUT of that kind could be ("files or folders", "objects")."""
    if not exists:
        return
    if not force:
        settled = "".join(f"; {note}" for note in notes)
        raise OutputExistsError(f"{out} already exists (pass --force to replace it, or -o to write elsewhere)"
                                f"{settled}", out)
    found = problem_of()
    if found:
        raise OutputExistsError(f"{out} exists and is not a packer dataset: it {found}; --force replaces only a "
                                f"dataset packer wrote, never other {others}; remove it yourself if it is not "
                                "needed, or choose -o elsewhere", out)


def problem(path: str) -> str | None:
    """What makes the existing path something --force may not replace, or None for a
    dataset packer wrote. The answer completes "OUT exists and ...": it says what was found."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    if stat.S_ISDIR(mode):
        return folder_problem(path)
    if stat.S_ISREG(mode):
        return file_problem(path)
    return "is not a file or folder"


def folder_problem(path: str) -> str | None:
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        return f"is a folder that cannot be listed ({exc.strerror})"
    marked = [fmt for fmt in FORMATS.values() if fmt.entry is not None and fmt.entry in entries]
    if not marked:
        marks = " or ".join(f"{fmt.entry} ({fmt.title})" for fmt in FORMATS.values() if fmt.entry is not None)
        return "is a folder " + (f"holding {listing(entries)}" if entries else "that is empty") + f", with no {marks}"
    meta, wrong = checked_metadata(path, marked[0])
    return wrong or marked[0].foreign(path, meta)


def file_problem(path: str) -> str | None:
    files = [fmt for fmt in FORMATS.values() if fmt.signature is not None]
    try:
        with open(path, "rb") as f:
            head = f.read(max(len(fmt.signature) for fmt in files))
    except OSError as exc:
        return f"is a file that cannot be read ({exc.strerror})"
    signed = [fmt for fmt in files if head.startswith(fmt.signature)]
    if not signed:
        titles = " or ".join(fmt.title for fmt in files)
        return f"is a file of {os.path.getsize(path)} bytes that is not {titles}"
    meta, wrong = checked_metadata(path, signed[0])
    return wrong or signed[0].foreign(path, meta)


def checked_metadata(path: str, fmt: Format) -> tuple[Metadata | None, str | None]:
    """(the metadata, None) if it is packer's, checked; (None, what was found) otherwise."""
    try:
        meta = fmt.read_metadata(path)
    except (PackError, OSError, lmdb.Error) as exc:
        return None, f"holds {fmt.held_as} without valid packer metadata ({reason(exc, path, fmt)})"
    return meta, metadata_problem(meta, fmt.name, fmt.held_as)


def metadata_problem(meta: Metadata, fmt: str, what: str) -> str | None:
    """What keeps checked metadata from proving packer wrote it as fmt, or None."""
    if meta.format != fmt:
        return f"holds {what} whose packer metadata says {meta.format!r}, not {fmt!r}"
    if not meta.sealed:
        return (f"holds {what} whose packer metadata has no checksum (a pack from before metadata checksums, or "
                "not packer's)")
    return None


def reason(exc: BaseException, path: str, fmt: Format) -> str:
    """An error's message without the path it starts with (the caller names it): OUT, or its entry file."""
    text = str(exc)
    prefixes = [f"{path}: "] + ([f"{os.path.join(path, fmt.entry)}: "] if fmt.entry else [])
    for prefix in prefixes:
        if text.startswith(prefix):
            return text[len(prefix):]
    return text
