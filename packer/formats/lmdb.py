"""LMDB: one environment folder (`OUT/data.mdb`) holding every split; writer and reader.

Keys are ASCII; all integers are little-endian.

  b"__meta__"                 UTF-8 JSON metadata (packer.records.Metadata)
  b"<split>/<index:010d>"     one record, index 0..count-1 in ImageFolder order:
      bytes 0..3   uint32  CRC-32 (zlib) of the image bytes
      bytes 4..7   int32   label (-1 = unlabeled)
      bytes 8..9   uint16  n = length of the relative path in bytes
      bytes 10..   n bytes relative path, UTF-8, "/"-separated
      then         the original file bytes, unchanged, to the end of the value
  b"<split>/labels"           int32[count], every record's label (so .targets needs no scan)
  b"<split>/paths"            relative paths, UTF-8, joined by NUL

Zero-padded decimal indexes sort in record order, so the writer appends (pages fill
completely) and a cursor walks records in order. The reader never scans keys: counts
come from the metadata. There is no lock file: packed data is immutable and opened
read-only with lock=False.
"""
from __future__ import annotations

import os
import struct

import lmdb
import numpy as np

from ..errors import CorruptDataError, FormatError
from ..records import Metadata, PathTable, decode_path, encode_path
from . import _handle
from ._reader import SplitReader

EXTENSION = ".lmdb"
DIRECTORY = True
META_KEY = b"__meta__"
HEADER = struct.Struct("<IiH")
DATA_FILE = "data.mdb"
# Commit about this many bytes per transaction: enough to amortise the commit; the map
# and file are grown ahead by twice this (room).
TXN_BYTES = 64 << 20
INITIAL_MAP_SIZE = 1 << 30
RESERVE_STEP = 8 << 20
# Readers across DDP ranks x DataLoader workers x threads; a read slot is a few bytes.
MAX_READERS = 2048
# posix_fallocate is what makes writemap safe on a full disk (Writer); without it, copy.
WRITEMAP = hasattr(os, "posix_fallocate")


def record_key(split: str, index: int) -> bytes:
    return b"%s/%010d" % (split.encode(), index)


def encode_record(data: bytes, label: int, relpath: str, crc: int) -> bytes:
    path = encode_path(relpath)
    return HEADER.pack(crc, label, len(path)) + path + data


def decode_record(value, where: str) -> tuple[bytes, int, str, int]:
    """Split a record value into (image bytes, label, relative path, stored CRC)."""
    if len(value) < HEADER.size:
        raise CorruptDataError(f"{where}: record is {len(value)} bytes, shorter than its header", where)
    crc, label, n = HEADER.unpack_from(value)
    if HEADER.size + n > len(value):
        raise CorruptDataError(f"{where}: record header names a {n}-byte path past the record's end", where)
    relpath = decode_path(bytes(value[HEADER.size:HEADER.size + n]))
    return bytes(value[HEADER.size + n:]), label, relpath, crc


def detect(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DATA_FILE))


class Writer:
    """Puts each record as it arrives, in transactions of about TXN_BYTES.

    With writemap, LMDB writes records straight into its memory map instead of copying
    every dirty page out at commit (2 GB committed in 1.5 s instead of 2.4-4.5 s here).
    Records go in one at a time rather than in a batch at commit, so each record's
    buffers are freed right away and reused for the next: holding a transaction's worth
    and freeing it at once let the allocator hand the memory back to the kernel, and
    faulting it in again took more time than the copies (README: "How fast packing is").

    That leaves no batch to replay if the map fills mid-transaction, so the map is grown
    before a transaction starts to hold the largest one possible (room). A mapped write
    to a full disk would kill the process with SIGBUS, so that file space is reserved
    with posix_fallocate first (a full disk is then an ordinary OSError), and the file,
    which LMDB sizes to the whole map, is cut back to the pages in use when finished.
    """

    def __init__(self, stage: str, options: dict):
        self.path = os.path.join(stage, DATA_FILE)
        self.writemap = WRITEMAP
        self.reserved = 0
        self.env = lmdb.open(stage, map_size=INITIAL_MAP_SIZE, subdir=True, lock=False, writemap=self.writemap,
                             sync=False, metasync=False, readahead=False, meminit=False)
        self.txn: lmdb.Transaction | None = None
        self.cursor: lmdb.Cursor | None = None
        self.txn_bytes = 0
        self.txn_start = 0
        self.split = ""
        self.index = 0

    def begin_split(self, split: str) -> None:
        self.split, self.index = split, 0

    def add(self, data: bytes, label: int, relpath: str, crc: int) -> None:
        self.put(record_key(self.split, self.index), encode_record(data, label, relpath, crc), append=True)
        self.index += 1

    def end_split(self, labels: np.ndarray, paths: PathTable) -> None:
        prefix = self.split.encode()
        self.put(prefix + b"/labels", labels.astype("<i4").tobytes(), append=False)
        self.put(prefix + b"/paths", paths.to_nul_separated(), append=False)

    def finish(self, meta: Metadata) -> None:
        self.put(META_KEY, meta.to_json(), append=False)
        self.commit()
        self.env.sync(True)
        used = self.used_bytes()
        self.env.close()
        if self.writemap:
            os.truncate(self.path, used)  # readers map what they need; the rest was never written

    def abort(self) -> None:
        if self.txn is not None:
            self.txn.abort()
            self.txn = None
        self.env.close()

    def put(self, key: bytes, value: bytes, append: bool) -> None:
        size = len(key) + len(value)
        if self.txn is not None and self.txn_bytes + size > TXN_BYTES:
            self.commit()
        if self.txn is None:
            self.begin(size)
        self.reserve(self.txn_start + room(self.txn_bytes + size))
        try:
            self.cursor.put(key, value, append=append)
        except lmdb.MapFullError as exc:  # room() makes this unreachable; say so if it is not
            raise FormatError(f"{self.path}: LMDB map full although it was grown to hold the transaction "
                              f"({self.env.info()['map_size']} bytes); please report this", self.path) from exc
        self.txn_bytes += size

    def begin(self, first: int) -> None:
        """Open a transaction on a map with room for the largest one possible."""
        self.txn_start = self.used_bytes()
        end = self.txn_start + room(max(TXN_BYTES, first))
        size = self.env.info()["map_size"]
        if end > size:
            self.env.set_mapsize(max(2 * size, end))
        self.txn = self.env.begin(write=True)
        self.cursor = self.txn.cursor()
        self.txn_bytes = 0

    def commit(self) -> None:
        if self.txn is not None:
            self.txn.commit()
            self.txn = self.cursor = None

    def used_bytes(self) -> int:
        return (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]

    def reserve(self, end: int) -> None:
        """Allocate the file up to at least `end` bytes, where writemap will write (writemap only).

        In steps of RESERVE_STEP, so a 2 GB pack makes a few hundred calls and a small one
        never holds more than a few MB it does not use.
        """
        if self.writemap and end > self.reserved:
            end = min(end + RESERVE_STEP, self.env.info()["map_size"])
            fd = os.open(self.path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, end)
            finally:
                os.close(fd)
            self.reserved = end


def room(txn_bytes: int) -> int:
    """Bytes of map a transaction putting txn_bytes of keys and values may need past the used pages.

    Each value over a page takes its own overflow pages (at most twice its size for
    values just over a page), small values fill leaf pages at least half; the branch
    pages copied on write and the free list add a few pages more.
    """
    return 2 * txn_bytes + (4 << 20)


def open_env(path: str) -> lmdb.Environment:
    # readahead stays on: turning it off (common advice for random access) made cold
    # random reads several times slower here, since each record spans several pages.
    return lmdb.open(path, readonly=True, lock=False, subdir=True, readahead=True,
                     max_readers=MAX_READERS, meminit=False)


def close_env(env: lmdb.Environment) -> None:
    env.close()


def read_metadata(path: str) -> Metadata:
    with _handle.borrowed(path, open_env, close_env) as env, env.begin() as txn:
        raw = txn.get(META_KEY)
    if raw is None:
        raise FormatError(f"{path}: LMDB without packer metadata (no {META_KEY.decode()} key); "
                          "an interrupted pack never publishes, so this was not written by packer pack", path)
    return Metadata.from_json(raw, path)


class Reader(SplitReader):
    """Random access to one split's records; safe to pickle and to use after fork."""

    def __init__(self, path: str, split: str | None = None, check_crc: bool = True):
        if not detect(path):
            raise FormatError(f"{path}: not an LMDB dataset (no {DATA_FILE} inside)", path)
        super().__init__(path, split, check_crc, read_metadata(os.path.abspath(path)))
        self._labels: np.ndarray | None = None
        self._paths: PathTable | None = None

    def _open(self):
        env = _handle.acquire(self.path, open_env, close_env)
        # One long-lived read transaction per process: the data never changes.
        return env, env.begin(buffers=True)

    def _close(self, handle) -> None:
        handle[1].abort()
        _handle.release(self.path)

    def read(self, index: int) -> tuple[bytes, int, str]:
        """(image bytes, label, relative path) of record index."""
        self.check_index(index)
        _, txn = self.handle()
        value = txn.get(record_key(self.split, index))
        if value is None:
            raise CorruptDataError(f"{self.where(index)}: record missing (the database is damaged; "
                                   "re-pack it or restore it from a copy)", self.path)
        data, label, relpath, crc = decode_record(value, self.where(index))
        self.check_data(data, crc, f"{self.where(index)} ({relpath})")
        return data, label, relpath

    def _aux(self, name: bytes) -> bytes:
        _, txn = self.handle()
        raw = txn.get(self.split.encode() + b"/" + name)
        if raw is None:
            raise CorruptDataError(f"{self.path}: missing key {self.split}/{name.decode()}", self.path)
        return bytes(raw)

    @property
    def labels(self) -> np.ndarray:
        if self._labels is None:
            self._labels = np.frombuffer(self._aux(b"labels"), dtype="<i4").astype(np.int32)
        return self._labels

    @property
    def paths(self) -> PathTable:
        if self._paths is None:
            self._paths = PathTable.from_nul_separated(self._aux(b"paths"))
        return self._paths
