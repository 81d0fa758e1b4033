"""LMDB's environment file as packer's readers open it: data.mdb checked to be the file a reader
read the metadata of, and to hold every page its meta pages say is in use, before LMDB maps it
(touching a mapped page past the end of a truncated file kills the process with SIGBUS); then
opened read-only, without a lock file, for a dataset that never changes. What packer stores
in the environment is packer.formats.lmdb's."""
from __future__ import annotations

import os
import struct

import lmdb

from ..errors import CorruptDataError
from . import _io
from ._tables import DAMAGED, dataset_identity, fd_identity, replaced_error

DATA_FILE = "data.mdb"  # LMDB's name for the file of an environment folder
# Readers across DDP ranks x DataLoader workers x threads; a read slot is a few bytes.
MAX_READERS = 2048
# LMDB 0.9's meta page (lmdb/mdb.c): a 16-byte page header (uint16 flags at byte 10), then
# MDB_meta at byte 16: uint32 magic, uint32 version, ..., the page size in the free DB's md_pad
# (byte 24 of MDB_meta), uint64 last page in use (byte 120) and txnid (byte 128).
META_PAGE = struct.Struct("<10xH4x II 16x I 92x Q Q")
P_META, MDB_MAGIC, MDB_VERSION = 0x08, 0xBEEFC0DE, 1


def data_identity(path: str) -> tuple:
    """The identity of path's data.mdb (_tables.dataset_identity)."""
    return dataset_identity(os.path.join(path, DATA_FILE))


def open_env(path: str, identity: tuple) -> lmdb.Environment:
    """LMDB's read-only environment of path, once data.mdb is known to be the file with this
    identity and to hold every page LMDB may map."""
    where = os.path.join(path, DATA_FILE)
    fd = _io.open_for_reading(where, "random")
    try:
        if fd_identity(fd) != identity:
            raise replaced_error(where)
        check_size(fd, where)
    finally:
        os.close(fd)
    try:
        # readahead stays on: turning it off (common advice for random access) made cold
        # random reads several times slower here, since each record spans several pages.
        env = lmdb.open(path, readonly=True, lock=False, subdir=True, readahead=True,
                        max_readers=MAX_READERS, meminit=False)
    except lmdb.Error as exc:
        if "already open" in str(exc):  # this inode is open here, under an identity it no longer has
            raise CorruptDataError(f"{where} was changed in place while a reader in this process has it open; "
                                   "close that reader first (packed data is never rewritten in place)",
                                   where) from exc
        raise CorruptDataError(f"{where}: LMDB cannot open it ({exc}); {DAMAGED}", where) from exc
    if data_identity(path) != identity:  # replaced between the check and the open
        env.close()
        raise replaced_error(where)
    return env


def check_size(fd: int, where: str) -> None:
    """Raise unless the file holds every page its newest meta page says is in use.

    Read with pread, never through LMDB's map: a mapped page past the end of a truncated
    file kills the process with SIGBUS when touched."""
    size = os.fstat(fd).st_size
    first = read_meta_page(fd, 0, size, where)
    second = read_meta_page(fd, first[0], size, where)
    psize, last_page, _ = max(first, second, key=lambda meta: meta[2])
    needed = (last_page + 1) * psize
    if size < needed:
        raise CorruptDataError(f"{where}: truncated: {size} bytes, the database needs {needed}; "
                               "restore it from a copy or re-pack", where)


def read_meta_page(fd: int, offset: int, size: int, where: str) -> tuple[int, int, int]:
    """(page size, last page in use, txnid) of the meta page at offset."""
    if _io.CAN_PREAD:
        raw = _io.pread(fd, META_PAGE.size, offset)
    else:
        os.lseek(fd, offset, os.SEEK_SET)
        raw = os.read(fd, META_PAGE.size)
    if len(raw) < META_PAGE.size:
        raise CorruptDataError(f"{where}: truncated: {size} bytes, too short to hold LMDB's meta pages; "
                               "restore it from a copy or re-pack", where)
    flags, magic, version, psize, last_page, txnid = META_PAGE.unpack(raw)
    if not flags & P_META or magic != MDB_MAGIC or version != MDB_VERSION or not 512 <= psize <= 65536 \
            or psize & (psize - 1) or last_page < 1:
        raise CorruptDataError(f"{where}: not a readable LMDB database (damaged meta page at byte {offset}); "
                               "restore it from a copy or re-pack", where)
    return psize, last_page, txnid


def close_env(env: lmdb.Environment) -> None:
    env.close()
