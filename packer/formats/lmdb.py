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
# Commit about this many bytes per transaction: large enough to amortise the commit,
# small enough that a retry after growing the map re-sends little.
TXN_BYTES = 64 << 20
INITIAL_MAP_SIZE = 1 << 30
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
    """Appends records in large transactions, doubling the map size whenever it fills.

    With writemap, LMDB writes records straight into its memory map instead of copying
    every dirty page out at commit (2 GB committed in 1.5 s instead of 2.4-4.5 s here).
    A mapped write to a full disk would kill the process with SIGBUS, so the file space
    each transaction may need is reserved first with posix_fallocate (a full disk is then
    an ordinary OSError), and the file, which LMDB sizes to the whole map, is cut back
    to the pages in use when finished.
    """

    def __init__(self, stage: str, options: dict):
        self.path = os.path.join(stage, DATA_FILE)
        self.writemap = WRITEMAP
        self.reserved = 0
        self.env = lmdb.open(stage, map_size=INITIAL_MAP_SIZE, subdir=True, lock=False, writemap=self.writemap,
                             sync=False, metasync=False, readahead=False, meminit=False)
        self.pending: list[tuple[bytes, bytes]] = []
        self.pending_bytes = 0
        self.split = ""
        self.index = 0

    def begin_split(self, split: str) -> None:
        self.split, self.index = split, 0

    def add(self, data: bytes, label: int, relpath: str, crc: int) -> None:
        value = encode_record(data, label, relpath, crc)
        self.pending.append((record_key(self.split, self.index), value))
        self.pending_bytes += len(value)
        self.index += 1
        if self.pending_bytes >= TXN_BYTES:
            self.flush()

    def end_split(self, labels: np.ndarray, paths: PathTable) -> None:
        self.flush()
        prefix = self.split.encode()
        self.commit([(prefix + b"/labels", labels.astype("<i4").tobytes()),
                     (prefix + b"/paths", paths.to_nul_separated())], append=False)

    def finish(self, meta: Metadata) -> None:
        self.flush()
        self.commit([(META_KEY, meta.to_json())], append=False)
        self.env.sync(True)
        used = self.used_bytes()
        self.env.close()
        if self.writemap:
            os.truncate(self.path, used)  # readers map what they need; the rest was never written

    def abort(self) -> None:
        self.env.close()

    def flush(self) -> None:
        if self.pending:
            self.commit(self.pending, append=True)
        self.pending, self.pending_bytes = [], 0

    def used_bytes(self) -> int:
        return (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]

    def reserve(self, need: int) -> None:
        """Allocate the file space a transaction of `need` bytes may write (writemap only)."""
        if not self.writemap:
            return
        end = min(self.env.info()["map_size"], self.used_bytes() + 2 * need + (16 << 20))
        if end > self.reserved:
            fd = os.open(self.path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, end)
            finally:
                os.close(fd)
            self.reserved = end

    def commit(self, items: list[tuple[bytes, bytes]], append: bool) -> None:
        need = sum(len(k) + len(v) for k, v in items)
        while True:
            self.reserve(need)
            try:
                with self.env.begin(write=True) as txn:
                    txn.cursor().putmulti(items, append=append)
                return
            except lmdb.MapFullError:
                # The failed transaction was aborted; nothing of it is in the file.
                size = self.env.info()["map_size"]
                self.env.set_mapsize(max(2 * size, size + 2 * need))


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
