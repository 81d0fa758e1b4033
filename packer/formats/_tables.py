"""Per-record tables as read from a file: their CRC-32s, their range checks and the file's identity.

Every table a reader loads (labels, paths, offsets, extents, order, records) is untrusted
input: it is checked once, when it loads, vectorised, so that reads need no checks of
their own. Packs written by this packer carry a CRC-32 of each table (each format's
docstring says where); packs written before carry none and are only range-checked.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..crc import crc32
from ..errors import CorruptDataError, FormatError

DAMAGED = "the dataset is damaged: restore it from a copy or re-pack it"


def table_crc(raw: bytes) -> int:
    """CRC-32 (zlib) of a table's bytes as stored."""
    return crc32(raw)


def encode_checksums(crcs: dict[str, int]) -> bytes:
    """The {table: CRC-32} object as stored (LMDB's `<split>/checksums`, HDF5's `checksums` attribute)."""
    return json.dumps(crcs, sort_keys=True, separators=(",", ":")).encode()


def decode_checksums(raw: bytes | str | None, where: str) -> dict[str, int] | None:
    """The {table: CRC-32} object stored at where; None where none is stored (an older pack)."""
    if raw is None:
        return None
    try:
        crcs = json.loads(raw)
        if isinstance(crcs, dict) and all(isinstance(k, str) and type(v) is int and 0 <= v <= 0xFFFFFFFF
                                          for k, v in crcs.items()):
            return crcs
    except (ValueError, TypeError):
        pass
    raise CorruptDataError(f"{where}: the table checksums are unreadable; {DAMAGED}", where)


def check_crc(raw: bytes, expected: int | None, where: str) -> None:
    """Raise unless raw's CRC-32 is expected (None: no checksum stored, nothing to check)."""
    if expected is not None and table_crc(raw) != expected:
        raise CorruptDataError(f"{where}: checksum mismatch, the table is damaged; {DAMAGED}", where)


def expected_crc(crcs: dict[str, int] | None, table: str, where: str) -> int | None:
    """The stored CRC-32 of table, None in an older pack; raise if a pack with checksums lacks it."""
    if crcs is None:
        return None
    if table not in crcs:
        raise CorruptDataError(f"{where}: no checksum stored for this table; {DAMAGED}", where)
    return crcs[table]


def check_count(found: int, count: int, where: str, what: str = "entries") -> None:
    if found != count:
        raise CorruptDataError(f"{where}: holds {found} {what}, the metadata says {count}; {DAMAGED}", where)


def check_labels(labels: np.ndarray, classes: int, labeled: bool, where: str) -> None:
    """Every label names a class, [0, classes), in a labeled split (an image without a class
    is never packed into one); all -1 (unlabeled) in an unlabeled split."""
    if not len(labels):
        return
    low, high = int(labels.min()), int(labels.max())
    if labeled and (low < 0 or high >= classes):
        raise CorruptDataError(f"{where}: labels range over [{low}, {high}], the dataset has {classes} classes "
                               f"(labels 0..{classes - 1}); {DAMAGED}", where)
    if not labeled and (low != -1 or high != -1):
        raise CorruptDataError(f"{where}: an unlabeled split holds labels other than -1; {DAMAGED}", where)


def check_within(offset: np.ndarray, length: np.ndarray, size, where: str, what: str) -> None:
    """Every [offset, offset + length) within [0, size) (size: one, or one per entry),
    computed without overflowing uint64."""
    offset, length = offset.astype(np.uint64), length.astype(np.uint64)
    size = np.broadcast_to(np.asarray(size).astype(np.uint64), offset.shape)
    bad = (length > size) | (offset > size - np.minimum(length, size))
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise CorruptDataError(f"{where}: {what} {first} lies at bytes {int(offset[first])}..+{int(length[first])}, "
                               f"past the end of its {int(size[first])}-byte file; {DAMAGED}", where)


def file_identity(path: str) -> tuple[int, int, int]:
    """What tells one file from the one that replaced it at the same path (pack --force
    writes a new file and renames it into place): inode, size and modification time.

    Not the device: an NFS client numbers devices itself, so the same file can show
    another st_dev on another machine (a Dataset pickled to a remote worker). A file
    rewritten in place, or merely touched, also counts as replaced."""
    return _identity(os.stat(path))


def dataset_identity(path: str) -> tuple[int, int, int]:
    """file_identity of a dataset's file, or a FormatError saying why it cannot be read."""
    try:
        return file_identity(path)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read it ({exc.strerror or exc})", path) from exc


def fd_identity(fd: int) -> tuple[int, int, int]:
    return _identity(os.fstat(fd))


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def replaced_error(what: str) -> CorruptDataError:
    return CorruptDataError(f"{what} was replaced since this Dataset was created (re-create the Dataset / "
                            "restart the DataLoader)", what)
