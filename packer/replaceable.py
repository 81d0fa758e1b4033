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
Anything else is refused by name, saying what was found there. packer.remote.upload asks
the same of a dataset at a URL, from its listing.
"""
from __future__ import annotations

import os
import stat

import h5py
import lmdb

from .errors import PackError
from .formats import FORMATS, hdf5, wds
from .formats.lmdb import DATA_FILE
from .records import Metadata

LMDB_LOCK = "lock.mdb"
# What packer writes in an HDF5 file (packer.formats.hdf5's layout).
HDF5_ROOT_ATTRS = {hdf5.META_ATTR, "classes"}
HDF5_TABLES = {"images", "offsets", "crc32", "labels", "paths", "order"}
SHOWN_NAMES = 5


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
    if DATA_FILE in entries:
        fmt, allowed = "lmdb", {DATA_FILE, LMDB_LOCK}
    elif wds.INDEX in entries:
        fmt, allowed = "wds", None
    else:
        return "is a folder " + (f"holding {listing(entries)}" if entries else "that is empty") + \
            f", with no {DATA_FILE} (LMDB) or {wds.INDEX} (WDS)"
    wrong = checked_metadata(path, fmt)[1]
    if wrong:
        return wrong
    if allowed is None:
        return wds_files_problem(path)
    return unexpected([os.path.join(path, entry) for entry in entries if entry not in allowed], fmt) or \
        not_a_file(os.path.join(path, DATA_FILE))


def file_problem(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(len(hdf5.HDF5_SIGNATURE))
    except OSError as exc:
        return f"is a file that cannot be read ({exc.strerror})"
    if head != hdf5.HDF5_SIGNATURE:
        return f"is a file of {os.path.getsize(path)} bytes that is not HDF5"
    meta, wrong = checked_metadata(path, "hdf5")
    return wrong or hdf5_members_problem(path, meta)


def checked_metadata(path: str, fmt: str) -> tuple[Metadata | None, str | None]:
    """(the metadata, None) if it is packer's, checked; (None, what was found) otherwise."""
    what = {"lmdb": f"a {DATA_FILE}", "wds": f"an {wds.INDEX}", "hdf5": "an HDF5 file"}[fmt]
    try:
        meta = FORMATS[fmt].read_metadata(path)
    except (PackError, OSError, lmdb.Error) as exc:
        return None, f"holds {what} without valid packer metadata ({reason(exc, path)})"
    return meta, metadata_problem(meta, fmt, what)


def metadata_problem(meta: Metadata, fmt: str, what: str) -> str | None:
    """What keeps checked metadata from proving packer wrote it as fmt, or None."""
    if meta.format != fmt:
        return f"holds {what} whose packer metadata says {meta.format!r}, not {fmt!r}"
    if not meta.sealed:
        return (f"holds {what} whose packer metadata has no checksum (a pack from before metadata checksums, or "
                "not packer's)")
    return None


def reason(exc: BaseException, path: str) -> str:
    """An error's message without the path it starts with (the caller names it)."""
    text = str(exc)
    for prefix in (f"{path}: ", f"{os.path.join(path, wds.INDEX)}: "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def wds_files_problem(path: str) -> str | None:
    """Anything in a checked WDS folder that its index does not name."""
    named = {wds.INDEX, *wds.named_files(wds.load_index(path)["wds"])}
    folders = {name.split("/", 1)[0] for name in named if "/" in name}
    extra = []
    for root, dirs, files in os.walk(path, onerror=lambda exc: extra.append(f"{exc.filename} (cannot be listed)")):
        relative = os.path.relpath(root, path)
        for name in dirs + files:
            entry = name if relative == "." else f"{relative}/{name}"
            full = os.path.join(root, name)
            if entry in folders and os.path.isdir(full) and not os.path.islink(full):
                continue
            if entry not in named or not_a_file(full):
                extra.append(full)
        dirs[:] = [name for name in dirs if (name if relative == "." else f"{relative}/{name}") in folders]
    return unexpected(extra, "wds")


def hdf5_members_problem(path: str, meta: Metadata) -> str | None:
    """Anything in a packer HDF5 file beyond its attributes and its splits' tables."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            extra = [f"attribute {name}" for name in f.attrs if name not in HDF5_ROOT_ATTRS]
            for name, member in f.items():
                if name not in meta.splits or not isinstance(member, h5py.Group):
                    extra.append(f"/{name}")
                    continue
                extra += [f"/{name}/{table}" for table in member if table not in HDF5_TABLES]
    except (OSError, ValueError) as exc:
        return f"is an HDF5 file that cannot be read whole ({exc})"
    if extra:
        return f"is an HDF5 file holding {listing(extra)}, which packer does not write"
    return None


def not_a_file(path: str) -> str | None:
    """Packer writes regular files: a link or anything else in their place is not its."""
    return None if stat.S_ISREG(os.lstat(path).st_mode) else f"holds {path}, which is not a regular file"


def unexpected(paths: list[str], fmt: str) -> str | None:
    if not paths:
        return None
    return f"holds a {fmt} dataset and also {listing(paths)}, which packer did not write"


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")
