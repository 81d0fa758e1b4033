"""LMDB: one environment folder (`OUT/data.mdb`) holding every split; writer and reader.

Keys are ASCII; all integers are little-endian.

  b"__meta__"                 UTF-8 JSON metadata (packer.records.Metadata)
  b"<split>/<position:010d>"  one record, position 0..count-1 in storage order:
      bytes 0..3   uint32  checksum of the image bytes, of the kind the metadata's
                           "checksum" names (packer.checksum; CRC-32 (zlib) where absent)
      bytes 4..7   int32   label (-1 = unlabeled)
      bytes 8..9   uint16  n = length of the relative path in bytes
      bytes 10..   n bytes relative path, UTF-8, "/"-separated
      then         the original file bytes, unchanged, to the end of the value
  b"<split>/labels"           int32[count], every record's label, by index
  b"<split>/paths"            relative paths by index, UTF-8, joined by NUL
  b"<split>/extents"          (uint64 offset, uint32 length)[count] by position, packed (12
                              bytes an entry, no padding): where each record's value lies
                              in data.mdb; (0, 0) where unknown (values small enough to
                              live inside B-tree pages, which move)
  b"<split>/order"            int32[count], only in shuffled packs: the index of the record
                              stored at each position
  b"<split>/positions"        int32[count], only in shuffled packs: where each record is stored,
                              by index (order's inverse: positions[order[j]] = j); missing in
                              packs written before it, whose readers work it out from order
  b"<split>/path_offsets"     uint64[count + 1] by index: path i is paths[offsets[i]:offsets[i + 1]
                              - 1] (offsets[0] = 0, offsets[count] = the size of paths + 1; an
                              empty split: the one entry 0); missing in packs written before it,
                              whose readers find the offsets by scanning paths for NULs
  b"<split>/sums"             uint32[count] by position: each record's checksum, the value
                              its header holds (format version 2; missing in packs written
                              before it, whose checked reads take the header's)
  b"<split>/checksums"        UTF-8 JSON {table: CRC-32 (zlib) of its value}, for each of the
                              tables above the split holds ("labels", "paths", "extents",
                              "order", "positions", "path_offsets", "sums"); missing in packs
                              written before table checksums, whose tables are then only
                              range-checked

A record's index is its ImageFolder rank. Storage order is ImageFolder order (position =
index, no order key) unless the pack was shuffled (--shuffle-seed), when order says which
record each position holds. Zero-padded decimal positions sort in storage order, so the
writer appends (pages fill completely) and a cursor walks records in storage order. The
reader never scans keys: counts come from the metadata. There is no lock file: packed data
is immutable and opened read-only with lock=False.

Readers fetch a record with one pread at its extent (_lmdb_extents), not through LMDB's map:
looking a record up faults in B-tree and overflow-header pages scattered through the file,
each a random read of the kernel's whole read-around window, which made cold random reads
slower than a folder of files (docs/cold-storage.md). Extents are taken while packing
from where writemap puts each value (overflow pages never move once written). A reader
checks a few records' headers against their labels and paths when it loads the extents;
if any differ (the database was rewritten, e.g. by mdb_copy -c) it uses the map instead.
A read is one pread of the image bytes alone, checked (check_crc) against the sums
table; only when that check fails is the record's header read, to tell extents gone
stale (the header does not name the record: the map is used from then on) from a
damaged record, which the map read then reports. In packs without sums a checked read
also preads the header (the checksum is there) and checks that it names the record. A
record read through the map (no extent) has its header's label and path checked
against the tables, and its image against the header's checksum.

Opening checks each table's length against the metadata's count and its ends; a read checks
the block of READ_BLOCK entries around its record on the block's first use (extents within
data.mdb, labels naming a class, path offsets where the paths start, positions whose order
entries name their records back), and check_tables (packer verify) checks every table whole with its CRC-32, as
HDF5's reader does (docs/safety.md). Tables with a checksum that fill overflow pages are
mapped from data.mdb where LMDB put them (found by walking the B-tree with preads,
_lmdb_pages.LMDBPages.locate: LMDB's own get faults in every page of the value), not copied
into each process (_tables), and CRC-checked when they are mapped up to CRC_AT_OPEN. Older packs' tables, and small ones, are copied and checked whole. Before LMDB
maps data.mdb, its two meta pages are read with pread and the file's size checked against
the pages they say are in use: touching a mapped page past the end of a truncated file
would kill the process with SIGBUS. Readers are tied to the data.mdb they read the
metadata of (inode, size, mtime: _tables.file_identity): a dataset replaced at
its path while in use (pack --force) is refused by a reader created before, in any
process that opens it afresh, rather than mixed with the old one.

A dataset named by URL (`s3://bucket/imagenet.lmdb`) is read without LMDB's map:
packer.formats._lmdb_pages walks the B-tree by ranged reads for the metadata and tables,
and records are read at their extents, as locally; opening fetches the meta pages and
the pages on the path to each table, never the whole file.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

import lmdb
import numpy as np

from ..checksum import MASK
from ..crc import crc32
from ..errors import CorruptDataError, FormatError
from ..records import Metadata, PathTable, check_split_name, decode_path, encode_path
from ..remote import source as remote_source
from ._index_tables import OFFSET, POSITION, inverse_chunks, offsets_of, path_offset_chunks, stored_positions
from ._lmdb_extents import EXTENT, HEADER, ExtentReads
from ._lmdb_pages import FileSource, LMDBPages
from . import _handle, _io
from ._contract import Format
from ._lmdb_env import DATA_FILE, close_env, data_identity, open_env
from ._foreign import not_a_file, unexpected
from ._reader import SplitReader
from ._tables import (DAMAGED, SpillTable, check_count, check_crc, crc_now, decode_checksums, drop_pages, encode_checksums,
                      expected_crc, map_region, nul_separated_view, region_view)

EXTENSION = ".lmdb"
DIRECTORY = True
META_KEY = b"__meta__"
LOCK_FILE = "lock.mdb"  # any LMDB tool adds it when it opens the database with locking
# Commit about this many bytes per transaction: enough to amortise the commit; the map
# and file are grown ahead by twice this (room).
TXN_BYTES = 64 << 20
INITIAL_MAP_SIZE = 1 << 30
RESERVE_STEP = 8 << 20
# posix_fallocate is what makes writemap safe on a full disk (Writer); without it, copy.
WRITEMAP = hasattr(os, "posix_fallocate")
SUM = np.dtype("<u4")  # a record's checksum, as the sums table stores it
# How often the pages a large table's put has copied are dropped from the packer's RSS
# (Writer.released_while_put): at the copy's few hundred MB/s, tens of MB resident at most.
RELEASE_EVERY = 0.05
CRC_STEP = 16 << 20  # bytes of a table CRC-checked between drops of its pages (crc_dropping_pages)
# Values at least a page long always live in overflow pages, which never move once written.
EXTENT_MIN = 4096


def record_key(split: str, index: int) -> bytes:
    return b"%s/%010d" % (split.encode(), index)


def encode_record(data: bytes, label: int, relpath: str, crc: int) -> bytes:
    path = encode_path(relpath)
    return HEADER.pack(crc, label, len(path)) + path + data


def decode_record(value, where: str) -> tuple[bytes, int, str, int]:
    """Split a record value into (image bytes, label, relative path, stored checksum)."""
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
    faulting it in again took more time than the copies (docs/benchmarks.md, "How fast
    packing is").

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
        self.map_base = self.locate_map()
        self.stage = stage
        self.extents: SpillTable | None = None
        self.sums: SpillTable | None = None

    def begin_split(self, split: str, expected_count: int | None = None) -> None:
        check_split_name(split)
        self.split, self.index = split, 0
        # Each record's extent and checksum, spilled to unlinked files as they come: the tables as stored.
        self.extents = SpillTable(EXTENT, self.stage)
        self.sums = SpillTable(SUM, self.stage)

    def add(self, data: bytes, label: int, relpath: str, crc: int) -> None:
        value = encode_record(data, label, relpath, crc)
        self.sums.append(crc)
        self.put(record_key(self.split, self.index), value, append=True)
        offset = 0
        if self.map_base is not None and len(value) >= EXTENT_MIN:
            # With writemap the cursor's value is the record in the map, where it stays.
            offset = np.frombuffer(self.cursor.value(), np.uint8).ctypes.data - self.map_base
        self.extents.append((offset, len(value) if offset else 0))
        self.index += 1

    def end_split(self, labels: np.ndarray, paths: PathTable, order: np.ndarray | None = None) -> None:
        """Write the split's tables; order[j] is the ImageFolder rank of the j-th added record."""
        prefix = self.split.encode()
        # Put as buffers, not copies: the arrays' bytes; the extents, sums and the paths (where
        # pack spilled them) straight from the maps of their files, whose pages are dropped after.
        # The path offsets and positions, worked out a chunk at a time, are spilled too.
        spilled = [self.extents, self.sums, spilled_table(OFFSET, path_offset_chunks(paths), self.stage)]
        tables = {"labels": np.ascontiguousarray(labels, "<i4").view(np.uint8), "paths": nul_separated_view(paths),
                  "extents": self.extents.map(), "sums": self.sums.map(), "path_offsets": spilled[2].map()}
        if order is not None:
            tables["order"] = np.asarray(order, "<i4").view(np.uint8)
            spilled.append(spilled_table(POSITION, inverse_chunks(order), self.stage))
            tables["positions"] = spilled[-1].map()
        crcs = {}
        for name, raw in tables.items():
            self.put(prefix + b"/" + name.encode(), raw, append=False)
            crcs[name] = crc_dropping_pages(raw)
            drop_pages(raw.obj if isinstance(raw, memoryview) else raw)
            if len(raw) >= TXN_BYTES:  # its pages out of our RSS (release_pages) before the next is put
                self.commit()
        tables.clear()
        for table in spilled:
            table.close()
        self.extents = self.sums = None
        self.put(prefix + b"/checksums", encode_checksums(crcs), append=False)

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
            with self.released_while_put(value):  # the map is not moved from here to the put's end
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
            self.map_base = self.locate_map()  # a larger map may be mapped elsewhere
        self.txn = self.env.begin(write=True, buffers=True)
        self.cursor = self.txn.cursor()
        self.txn_bytes = 0

    def commit(self) -> None:
        if self.txn is not None:
            self.txn.commit()
            self.txn = self.cursor = None
            if self.map_base is not None:  # the pages just written stay in the page cache, not in our RSS
                release_pages(self.map_base + self.txn_start, self.used_bytes() - self.txn_start)

    def released_while_put(self, raw):
        """A context in which the pages of a large table's source map and of LMDB's map are
        dropped from our RSS every RELEASE_EVERY seconds while LMDB copies the table in (one
        put, which releases the GIL): they stay in the page cache, the copy's written pages
        dirty, and fault back in if touched. Without it both copies of the table are resident
        at once until the commit (twice the path table: 3.3 GB at 10^8 records). Large
        tables with writemap only; otherwise nothing."""
        if self.map_base is None or len(raw) < TXN_BYTES:
            return contextlib.nullcontext()
        # Fixed now: a map moved by set_mapsize (begin) while the thread ran could let it drop
        # pages of whatever was mapped there next.
        source, base, length = raw.obj if isinstance(raw, memoryview) else raw, self.map_base, self.reserved
        return pages_released(lambda: (drop_pages(source), release_pages(base, length)))

    def locate_map(self) -> int | None:
        """Where data.mdb is mapped, when values are written straight into the map (writemap)."""
        return _io.mapped_at(self.path) if self.writemap else None

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


def spilled_table(dtype, chunks, folder: str) -> SpillTable:
    """A table worked out in chunks, spilled to an unlinked file in folder (mapped to be put)."""
    table = SpillTable(dtype, folder)
    for chunk in chunks:
        table.extend(chunk)
    return table


def crc_dropping_pages(raw) -> int:
    """table_crc(raw), CRC_STEP bytes at a time, the pages of raw's map dropped after each: a
    table mapped from a spill file is never resident whole (the path table: 1.7 GB at 10^8)."""
    view, source, value = memoryview(raw).cast("B"), raw.obj if isinstance(raw, memoryview) else raw, 0
    for start in range(0, len(view), CRC_STEP):
        value = crc32(view[start:start + CRC_STEP], value)
        drop_pages(source)
    return value


def release_pages(address: int, length: int) -> None:
    """Drop a range of the writemap map from this process's page tables (madvise
    MADV_DONTNEED). The map is a shared file map, so the written pages stay in the page
    cache (dirty ones are written back as usual) and fault back in if touched; without
    this every page written stays mapped, and the packer's resident memory grows with
    the dataset (RSS counts mapped file pages). A no-op where madvise is unavailable."""
    if WRITEMAP:
        _io.advise_pages(address, length, _io.MADV_DONTNEED)


@contextlib.contextmanager
def pages_released(release, every: float = None):
    """Call release() every `every` seconds (RELEASE_EVERY) on a thread of its own while the
    body runs, and once more after it."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(RELEASE_EVERY if every is None else every):
            release()
    thread = threading.Thread(target=run, name="lmdb-release-pages", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        release()


def room(txn_bytes: int) -> int:
    """Bytes of map a transaction putting txn_bytes of keys and values may need past the used pages.

    Each value over a page takes its own overflow pages (at most twice its size for
    values just over a page), small values fill leaf pages at least half; the branch
    pages copied on write and the free list add a few pages more.
    """
    return 2 * txn_bytes + (4 << 20)


def read_metadata(path: str, identity: tuple | None = None) -> Metadata:
    identity = identity or data_identity(path)
    opener = functools.partial(open_env, identity=identity)
    with _handle.borrowed(path, opener, close_env, identity) as env, env.begin() as txn:
        raw = txn.get(META_KEY)
    if raw is None:
        raise FormatError(f"{path}: LMDB without packer metadata (no {META_KEY.decode()} key); "
                          "an interrupted pack never publishes, so this was not written by packer pack", path)
    return Metadata.from_json(raw, path)


def remote_metadata(url: str, remote) -> tuple[str, tuple, Metadata]:
    """(data.mdb's URL, its identity, the Metadata) of the LMDB dataset at url, read by pages."""
    where = remote_source.join(url, DATA_FILE)
    identity = remote_source.dataset_object_identity(remote, where, url,
                                                     f"not an LMDB dataset (no {DATA_FILE} at {where})")
    raw = LMDBPages(remote.open(where, identity), where).get(META_KEY)
    if raw is None:
        raise FormatError(f"{url}: LMDB without packer metadata (no {META_KEY.decode()} key)", url)
    return where, identity, Metadata.from_json(raw, url)


class Reader(ExtentReads, SplitReader):
    """Random access to one split's records; safe to pickle and to use after fork.

    path may be a URL; storage_options, cache_dir, cache_limit and block_size then say
    how to read it (packer.remote.source.Remote)."""

    TABLES = {"_extents": None, "_extent_at": None, "_extent_length": None, "_extent_blocks": None,
              "_sums": None}
    MAPS_DATA_FILE = True

    def __init__(self, path: str, split: str | None = None, check_crc: bool = True, **remote):
        remote = remote_source.remote_for(path, **remote)
        if remote is None:
            self.init_local(path, split, check_crc)
        else:
            where, identity, metadata = remote_metadata(path, remote)
            super().__init__(path, split, check_crc, metadata, where, identity)
            self.read_remotely(remote)

    def init_local(self, path: str, split: str | None, check_crc: bool) -> None:
        if not detect(path):
            raise FormatError(f"{path}: not an LMDB dataset (no {DATA_FILE} inside)", path)
        path = os.path.abspath(path)
        identity = data_identity(path)
        super().__init__(path, split, check_crc, read_metadata(path, identity), os.path.join(path, DATA_FILE),
                         identity)

    def _open(self):
        if self.remote is not None:
            source = self.open_identified()
            pages = LMDBPages(source, self.identity_file)
            return pages, pages, source  # the pages answer get() as the transaction does
        env, fd = self.open_shared(open_env, close_env)
        # One long-lived read transaction per process: the data never changes.
        return env, env.begin(buffers=True), fd

    def _close(self, handle) -> None:
        handle[1].abort()
        _io.close(handle[2])
        _handle.release(self.path, self.identity)

    def read_record(self, index: int) -> tuple[bytes, int]:
        self.check_index(index)
        position = self.position(index)
        found = self.read_at_extent(position, index)
        if found is not None:
            data, crc = found
            if crc is None or self.record_digest(data) & MASK == crc:
                return data, self.label(index)
            self.check_extent_header(position, index)  # stale extents are dropped; damage is reported below
        data, crc = self.read_through_map(position, index)
        self.check_data(data, crc, index)
        return data, self.label(index)

    def read_through_map(self, position: int, index: int) -> tuple[bytes, int]:
        """(image bytes, the checksum its header holds) of the record at position, read
        through LMDB's map, its header checked to name record index."""
        self.check_not_cut()
        try:
            value = self.handle()[1].get(record_key(self.split, position))
        except lmdb.Error as exc:  # a damaged B-tree page on the way to the record
            raise CorruptDataError(f"{self.where(index)}: LMDB cannot read it ({exc}); {DAMAGED}", self.path) from exc
        if value is None:
            raise CorruptDataError(f"{self.where(index)}: record missing (the database is damaged; "
                                   "re-pack it or restore it from a copy)", self.path)
        data, label, relpath, crc = decode_record(value, self.where(index))
        if label != self.label(index) or relpath != self.path_of(index):
            raise CorruptDataError(f"{self.where(index)}: the record's header says label {label}, path "
                                   f"{relpath!r}; the tables say {self.label(index)}, "
                                   f"{self.path_of(index)!r}; {DAMAGED}", self.path)
        return data, crc

    def load_tables(self) -> None:
        self.extents()
        if self.check_crc and self.remote is None:  # remote reads take the header's (read_whole_value)
            self.record_sums()

    def read_order(self) -> np.ndarray | None:
        found = self.loaded("order", lambda: self.table(b"order", required=False))
        return None if found is None else self.checked_order(self.entries_of(found, "<i4", self.table_where(b"order")))

    def _aux(self, name: bytes, required: bool = True) -> bytes | None:
        _, txn, _ = self.handle()
        raw = txn.get(self.split.encode() + b"/" + name)
        if raw is None:
            if not required:
                return None
            raise CorruptDataError(f"{self.table_where(name)}: key missing; {DAMAGED}", self.path)
        return bytes(raw)

    def table_where(self, name: bytes) -> str:
        return f"{self.identity_file} key {self.split}/{name.decode()}"

    def table_checksums(self) -> dict | None:
        return self.loaded("checksums", lambda: decode_checksums(self._aux(b"checksums", required=False),
                                                                 self.table_where(b"checksums")))

    def table(self, name: bytes, required: bool = True, crc: bool = True) -> tuple | None:
        """Table `<split>/<name>` as (buffer, start, length): its bytes are
        buffer[start:start + length], checked against its stored CRC-32 if it has one (with
        crc False, only a table copied or mapped up to CRC_AT_OPEN: reads check the blocks
        of a larger one they use, check_layout_tables all of it)."""
        crcs, where, key = self.table_checksums(), self.table_where(name), self.split.encode() + b"/" + name
        _, txn, fd = self.handle()
        expected = expected_crc(crcs, name.decode(), where) if crcs is not None and name.decode() in crcs else None
        if expected is not None and self.remote is None:
            # Found by walking the B-tree with preads (LMDB's own get would fault in every page).
            found = LMDBPages(FileSource(fd), self.identity_file).locate(key)
            if found is not None:
                region, start = map_region(fd, *found, where)
                if crc or crc_now(found[1]):
                    check_crc(region_view(region, start, found[1]), expected, where)
                return region, start, found[1]
        value = txn.get(key)
        if value is None:
            if required or (crcs is not None and name.decode() in crcs):
                raise CorruptDataError(f"{where}: key missing; {DAMAGED}", self.path)
            return None
        expected = expected_crc(crcs, name.decode(), where)
        raw = bytes(value)
        check_crc(raw, expected, where)
        return raw, 0, len(raw)

    def load_labels(self) -> np.ndarray:
        labels = np.asarray(self.entries_of(self.table(b"labels"), "<i4", self.table_where(b"labels")), np.int32)  # no copy
        return self.checked_labels(labels, self.table_where(b"labels"))

    def map_labels(self) -> tuple[np.ndarray, str]:
        where = self.table_where(b"labels")
        return self.entries_of(self.table(b"labels", crc=False), "<i4", where), where

    def stored_path_offsets(self) -> tuple | None:
        found, where = self.table(b"path_offsets", required=False, crc=False), self.table_where(b"path_offsets")
        return None if found is None else (offsets_of(found, where, self.path), where)

    def mapped_paths(self) -> tuple:
        return self.table(b"paths", crc=False)

    def path_lengths(self, indexes: np.ndarray) -> np.ndarray:
        """Each record's path length in bytes (int64), vectorised."""
        found = self.path_index() if self._path_index is None else self._path_index
        if found is not False:
            return found.lengths(indexes)
        offsets = self.paths.offsets
        return offsets[indexes + 1].astype(np.int64) - offsets[indexes] - 1

    def stored_positions(self) -> tuple | None:
        found, where = self.table(b"positions", required=False, crc=False), self.table_where(b"positions")
        if found is None:
            return None
        order = self.table(b"order", required=False, crc=False)
        return stored_positions(self.entries_of(found, POSITION, where),
                                None if order is None else self.entries_of(order, "<i4", self.table_where(b"order")),
                                where, self.path)

    def check_layout_tables(self) -> None:
        """The CRC-32s of the tables reads map (labels and paths are checked as they load
        whole), and every block of each (extents, path offsets, positions)."""
        for name in (b"extents", b"sums", b"path_offsets", b"positions"):
            self.table(name, required=False)
        if self.extents() is not None:
            self._extent_blocks.ensure_every()
        self.check_path_index()
        if self.position_table() is not False and self._position_checks is not None:
            self.storage_order()  # order's CRC-32, and a permutation: positions, checked below, is its inverse
            self._position_checks.ensure_every()

    def load_paths(self) -> PathTable:
        buffer, start, length = self.table(b"paths")
        paths = PathTable.from_nul_separated(buffer, self.table_where(b"paths"), start, length)
        check_count(len(paths), self.count, self.table_where(b"paths"), "paths")
        return paths


def read_remote(url: str, remote) -> tuple[Metadata, set[str]]:
    """(Metadata, the names packer's LMDB folder holds) of the LMDB dataset at url."""
    return remote_metadata(url, remote)[2], {DATA_FILE, LOCK_FILE}


def foreign(path: str, meta: Metadata) -> str | None:
    """Anything in a packer LMDB folder but data.mdb, as a regular file, and lock.mdb."""
    extra = [os.path.join(path, entry) for entry in sorted(os.listdir(path)) if entry not in {DATA_FILE, LOCK_FILE}]
    return unexpected(extra, "lmdb") or not_a_file(os.path.join(path, DATA_FILE))


FORMAT = Format(name="lmdb", aliases=("mdb",), extension=EXTENSION, directory=DIRECTORY, Writer=Writer,
                Reader=Reader, detect=detect, read_metadata=read_metadata, title="LMDB", held_as=f"a {DATA_FILE}",
                entry=DATA_FILE, read_remote=read_remote, foreign=foreign)
