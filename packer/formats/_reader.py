"""The common ground of every format's Reader: split choice, count, CRC policy, record names,
access pattern and storage order, tables loaded (and checked) once, and the identity of the
dataset file a reader belongs to.

A dataset named by URL (s3://, gs://, https://) is read through packer.remote: its
descriptors are byte sources that _io serves like file descriptors, its identity is the
object's (ETag, size, modification time), and a record that fails its check is read once
more past the cache before the damage is reported (read_record_refetched)."""
from __future__ import annotations

import functools
import os

import numpy as np

from .. import checksum as record_checksums
from ..checksum import MASK
from ..errors import CorruptDataError, PackError
from ..remote import source as remote_source
from ..records import Metadata, choose_split
from . import _handle
from ._handle import LazyHandle
from ._io import cached, check_access, open_for_reading, will_need
from ._tables import (DAMAGED, BlockChecks, check_count, check_crc, check_labels, checked_whole, crc_now, expected_crc,
                      fd_identity, file_identity, is_permutation, map_region, region_view, replaced_error)


_UNREAD = object()


def current_identity(path: str, remote=None) -> tuple | None:
    """The identity of the file (or, with remote, the object) now at path: _tables.file_identity,
    or Remote.identity; None when there is none there (gone, mid-replacement)."""
    try:
        return file_identity(path) if remote is None else remote.identity(path)
    except OSError:
        return None
    except remote_source.RemoteError as exc:
        if not remote_source.missing(exc):
            raise
        return None


class SplitReader(LazyHandle):
    """One split of a packed dataset. Subclasses add the layout: _open/_close and
    read_record(i), and read_order() where records may be stored out of index order.

    Tables are loaded in each process that reads (mapped from the dataset's file where the
    layout allows, see _tables): pickling leaves them out, so a Dataset sent to a spawned
    worker or another rank carries its paths and counts, not tens of MB of tables."""

    _order = _UNREAD  # storage_order(), read once
    _label_blocks = None  # (mapped labels, BlockChecks) for label()
    _labels = None  # the labels property: the label table, checked whole
    _paths = None  # the paths property: the path table (PathTable), checked whole
    remote = None  # packer.remote.source.Remote where the dataset is a URL
    # index -> stored position, built from storage_order(); False: the index itself
    _position: np.ndarray | bool | None = None
    # Whether read_image finds a record by its stored position (open() builds that table).
    reads_by_position = True
    # The attributes that hold loaded tables, with their values before loading: pickling
    # resets them (subclasses add their own).
    TABLES: dict = {}
    # Whether a local reader maps its tables from the data file handle()[2] (check_not_cut).
    MAPS_DATA_FILE = False

    def __init__(self, path: str, split: str | None, check_crc: bool, metadata: Metadata,
                 identity_file: str | None = None, identity: tuple | None = None):
        self.path = path if remote_source.is_url(path) else os.path.abspath(path)
        self.metadata = metadata
        self.split = choose_split(list(metadata.splits), split, self.path)
        self.classes = metadata.classes
        self.count = metadata.splits[self.split].count
        self.check_crc = check_crc
        # The pack's record checksum kind (packer.checksum): the function computing it, and
        # the C function whose result & MASK it is, which reads call (no Python frame).
        self.record_checksum = record_checksums.function(metadata.checksum)
        self.record_digest = record_checksums.digest(metadata.checksum)
        self.access = "random"
        # The file whose identity (_tables.file_identity) ties this reader to the dataset it
        # read the metadata of: every handle opened later, in any process, must be of it.
        self.identity_file = identity_file
        self.identity = identity
        self._loaded: dict = {}

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(self.TABLES, _loaded={})
        for name in ("_order", "_position", "_label_blocks", "_labels", "_paths"):
            state.pop(name, None)  # this process's maps: each process loads its own
        return state

    def check_identity(self, identity: tuple | None = None) -> None:
        """Raise if the dataset was replaced at its path since this reader read its metadata
        (identity: of a file just opened; else the file now at the path)."""
        now = identity if identity is not None else current_identity(self.identity_file, self.remote)
        if now != self.identity:
            raise replaced_error(self.identity_file)

    def check_not_cut(self) -> None:
        """Raise if the file this reader maps its tables from is now shorter than when it was
        made. A mapped page past the new end kills the process (SIGBUS) when touched, so
        readers' __getitems__ checks once per batch: most such cuts are then an error, and
        one that races a batch can still crash it. Only formats whose tables are mapped
        from their one local data file (MAPS_DATA_FILE: the descriptor is handle()[2])
        check; WebDataset's tables live in files of their own."""
        if not self.MAPS_DATA_FILE or self.remote is not None:
            return
        size, made = os.fstat(self.handle()[2]).st_size, self.identity[1]
        if size < made:
            raise CorruptDataError(f"{self.identity_file}: truncated while in use: {size} bytes, {made} when this "
                                   "Dataset was made; restore it from a copy or re-pack, then restart the DataLoader",
                                   self.identity_file)

    def open_identified(self) -> int:
        """A descriptor of identity_file, checked to be the file this reader read the metadata of."""
        if self.remote is not None:
            return self.remote.open(self.identity_file, self.identity)
        try:
            fd = open_for_reading(self.identity_file, self.access)
        except OSError as exc:
            self.check_identity()  # gone or replaced: say that
            raise CorruptDataError(f"{self.identity_file}: cannot open it ({exc.strerror or exc})",
                                   self.identity_file) from exc
        try:
            self.check_identity(fd_identity(fd))
        except CorruptDataError:
            os.close(fd)
            raise
        return fd

    def open_member(self, name: str, size: int | None = None):
        """A descriptor (a byte source for a URL) of one of the dataset's own files, name
        relative to it, checked to belong to the dataset this reader read (opened, then the
        dataset's identity checked); at a URL, also to be size bytes, as its index says."""
        where = os.path.join(self.path, name)
        if self.remote is not None:
            self.check_identity()
            try:
                source = self.remote.open(where)
            except remote_source.RemoteError as exc:
                if remote_source.missing(exc):
                    raise CorruptDataError(f"{where}: shard missing; upload the dataset again", self.path) from exc
                raise
            if size is not None and source.size != size:
                raise CorruptDataError(f"{where}: {source.size} bytes, the index says {size}; the shard was "
                                       "changed or not uploaded whole (upload the dataset again)", self.path)
            return source
        try:
            fd = open_for_reading(where, self.access)
        except OSError as exc:
            self.check_identity()
            raise CorruptDataError(f"{where}: cannot open the shard ({exc.strerror or exc}); restore it from "
                                   "a copy or re-pack the dataset", self.path) from exc
        try:
            self.check_identity()  # after the open: the file opened is of the dataset this reader read
        except CorruptDataError:
            os.close(fd)
            raise
        return fd

    def table_file(self, table: str, name: str, size: int | None = None, entry_size: int = 1,
                   crc: bool = True) -> tuple:
        """A table in a file of its own (name, relative to the dataset) as (map, start, length):
        mapped (at a URL, read whole), checked to be of the dataset this reader read, against the
        table's CRC-32 where table_checksums() has one (with crc; a table read whole always), and
        to be size bytes where size is given (entry_size: the bytes of one record's entry, for
        the message)."""
        where = os.path.join(self.path, name)
        if self.remote is not None:
            self.check_identity()
            raw = self.remote.read_object(where)
            self.check_table_size(where, len(raw), size, entry_size)
            check_crc(raw, expected_crc(self.table_checksums(), table, where), where)
            return raw, 0, len(raw)
        try:
            fd = os.open(where, os.O_RDONLY)
        except OSError as exc:
            raise CorruptDataError(f"{where}: cannot read it ({exc.strerror or exc}); {DAMAGED}", self.path) from exc
        try:
            self.check_identity()  # opened before the check: fd is of the dataset this reader read
            found = os.fstat(fd).st_size
            self.check_table_size(where, found, size, entry_size)
            region, start = map_region(fd, 0, found, where)  # the map outlives the descriptor
        finally:
            os.close(fd)
        expected = expected_crc(self.table_checksums(), table, where)
        if crc or crc_now(found):
            check_crc(region_view(region, start, found), expected, where)
        return region, start, found

    def check_table_size(self, where: str, found: int, size: int | None, entry_size: int) -> None:
        if size is not None and found != size:
            raise CorruptDataError(f"{where}: {found} bytes, {size // entry_size} records of {entry_size} bytes "
                                   f"take {size}; {DAMAGED}", self.path)

    def open_shared(self, opener, closer) -> tuple:
        """(this process's shared handle of the dataset file, opened by opener(path,
        identity=...) and closed by closer, and a descriptor of it for preads), both
        checked to be the file this reader read the metadata of."""
        fd = self.open_identified()
        try:
            return _handle.acquire(self.path, functools.partial(opener, identity=self.identity), closer,
                                   self.identity), fd
        except BaseException:
            os.close(fd)
            raise

    def read_remotely(self, remote) -> None:
        """Read this dataset through packer.remote (called by a format's reader for a URL):
        read_image then re-fetches a record found damaged (read_record_refetched)."""
        self.remote = remote

    def read_record_refetched(self, index: int) -> tuple[bytes, int]:
        """read_image of a remote dataset: a record found damaged is read once more, its
        cached blocks dropped first (a block damaged on the way or in the cache is fetched
        again); damage that persists is the stored object's, and is reported as such."""
        read = self.read_record
        remote_source.start_log()
        try:
            return read(index)
        except CorruptDataError:
            reads = remote_source.stop_log()
            if not reads:
                raise
        finally:
            remote_source.stop_log()
        for source, offset, length in reads:
            source.invalidate(offset, length)
        try:
            return read(index)
        except CorruptDataError as exc:
            raise CorruptDataError(f"{exc} [read twice from {self.path}, the second time past the cache: the "
                                   "stored copy is damaged]", exc.path, exc.reason) from None

    def loaded(self, name: str, load):
        """Table name as load() returns it, loaded once: a damaged table's error is kept too,
        so every later read reports it without reading the table again."""
        if name not in self._loaded:
            try:
                self._loaded[name] = (load(), None)
            except PackError as exc:
                self._loaded[name] = (None, exc)
                raise
        value, error = self._loaded[name]
        if error is not None:
            raise error.with_traceback(None)  # not a traceback that grows with every read
        return value

    @property
    def tables_checked(self) -> bool:
        """Whether this split's per-record tables carry checksums, checked as they load (packs
        written before table checksums carry none: their tables are only range-checked)."""
        return self.table_checksums() is not None

    def table_checksums(self) -> dict | None:
        """{table: CRC-32} stored for this split, None in an older pack."""
        return None

    def entries_of(self, found: tuple, dtype, where: str) -> np.ndarray:
        """A table's bytes, found as (buffer, start, length), as one dtype entry per record,
        checked to hold exactly count of them."""
        buffer, start, length = found
        dtype = np.dtype(dtype)
        if length % dtype.itemsize:
            raise CorruptDataError(f"{where}: {length} bytes, not a whole number of "
                                   f"{dtype.itemsize}-byte entries; {DAMAGED}", self.path)
        check_count(length // dtype.itemsize, self.count, where)
        return np.frombuffer(buffer, dtype, length // dtype.itemsize, start)

    def checked_labels(self, labels: np.ndarray, where: str) -> np.ndarray:
        """A label table, checked against the class list (-1 only in unlabeled splits)."""
        check_labels(labels, len(self.classes), self.metadata.splits[self.split].labeled, where)
        return labels

    def open(self) -> "SplitReader":
        """Open this process's handle and map the tables reads use, now rather than on the
        first read (e.g. ahead of a timed loop). Returns self.

        Nothing here passes over a table (a pack of 10^8 records opens as fast as one of
        10^4): what is checked now is each table's size and ends; each block of a table
        reads use is range-checked on its first use (BlockChecks), the path table when it
        is first used, and the tables' CRC-32s by check_tables (packer verify). Record
        bytes are checked against their own checksum at every read. docs/safety.md."""
        self.handle()
        if self.reads_by_position:
            self.position_table()
        self.load_tables()
        if self._label_blocks is None:
            self._label_blocks = self.loaded("label blocks", self.label_blocks)
        if self.remote is not None:
            # At a URL every table is read whole into this process (no map to share), the path
            # table too, now: loaded later, a damaged record's report would fetch it inside
            # read_record_refetched's retry, which drops and fetches again all that read fetched.
            self.paths
        return self

    def check_tables(self) -> None:
        """Read every table whole and check it: CRC-32s, every entry's range, every path's
        safety. What packer verify does before it reads the records."""
        self.open()
        self.labels, self.paths  # properties: read, checked whole and cached on first access
        self.check_layout_tables()

    @property
    def labels(self) -> np.ndarray:
        """Every record's label (int32, mapped where the layout allows), the whole table
        checked once, on first access (load_labels): what check_tables, verify and class
        statistics use. A read takes its label through label(), which checks a block."""
        if self._labels is None:
            self._labels = self.loaded("labels", self.load_labels)
        return self._labels

    @property
    def paths(self):
        """Every record's relative path (a packer.records.PathTable over the mapped table),
        the whole table checked once, on first access (load_paths)."""
        if self._paths is None:
            self._paths = self.loaded("paths", self.load_paths)
        return self._paths

    def load_labels(self) -> np.ndarray:
        """The label table, checked whole: its CRC-32 and every label's range."""
        raise NotImplementedError

    def load_paths(self):
        """The path table, checked whole: its CRC-32, its count and every path."""
        raise NotImplementedError

    def load_tables(self) -> None:
        """Map the layout's own per-record tables (extents, offsets, chunk map); none here."""

    def check_layout_tables(self) -> None:
        """Check the layout's own tables whole (check_tables); none here."""

    def label(self, index: int) -> int:
        """Record index's label (index in range): from the mapped label table, whose block
        around index is range-checked on its first use (labels: the whole table, checked whole)."""
        if self._label_blocks is None:
            self._label_blocks = self.loaded("label blocks", self.label_blocks)
        labels, checks = self._label_blocks
        checks.ensure(index)
        return labels.item(index)

    def label_blocks(self) -> tuple:
        """(the label table, mapped, and its BlockChecks); at a URL, the table read whole
        (labels), once, checked whole."""
        if self.remote is not None:
            return self.labels, BlockChecks(self.count, checked_whole)
        labels, where = self.map_labels()
        check_count(len(labels), self.count, where)
        classes, labeled = len(self.classes), self.metadata.splits[self.split].labeled

        def check(start: int, stop: int) -> None:  # not a method: the reader holds it, so no cycle
            check_labels(labels[start:stop], classes, labeled, where)
        return labels, BlockChecks(self.count, check)

    def map_labels(self) -> tuple[np.ndarray, str]:
        """(the label table as stored, unchecked, where it is): label() checks it a block at a
        time. Here the whole table, checked whole; formats that map it say so."""
        return self.labels, f"{self.path} {self.split} labels"

    def advise(self, access: str) -> None:
        """Tell the reader how records will be read: "random" (fetch exactly each record)
        or "sequential" (storage order or blocks of it: let the kernel read ahead).
        Takes effect when this process next opens the reader."""
        access = check_access(access)
        if access != self.access:
            self.close()
            self.access = access

    def storage_order(self) -> np.ndarray | None:
        """Index of the record stored at each position, or None when that is the index itself."""
        if self._order is _UNREAD:
            self._order = self.read_order()
        return self._order

    def read_order(self) -> np.ndarray | None:
        """The layout's storage order (see storage_order); None here: index order."""
        return None

    def position_table(self) -> np.ndarray | bool:
        """Index -> stored position, built once from storage_order(); False: the index itself."""
        if self._position is None:
            order = self.storage_order()
            if order is None:
                self._position = False
            else:  # the inverse permutation, int32 (counts are below 2**31): half of argsort's int64
                self._position = np.empty(len(order), np.int32)
                self._position[order] = np.arange(len(order), dtype=np.int32)
        return self._position

    def position(self, index: int) -> int:
        """Where record index is stored."""
        table = self.position_table() if self._position is None else self._position
        return index if table is False else table.item(index)

    def checked_order(self, order: np.ndarray) -> np.ndarray:
        """A stored order table, checked to be a permutation of the records; int32, kept as
        it is when it is already (a mapped table stays mapped)."""
        order = np.asarray(order, np.int32)
        if len(order) != self.count or not is_permutation(order):
            raise CorruptDataError(f"{self.path}: the {self.split} order table is not a permutation of "
                                   f"{self.count} records; the dataset is damaged, re-pack it", self.path)
        return order

    def will_need(self, start: int, stop: int) -> None:
        """Hint that the records stored at positions [start, stop) are read soon (no-op here)."""

    def will_need_records(self, indexes) -> int:
        """Hint that the records `indexes` (any order) are read soon: the kernel starts
        reading the bytes of each one not in the page cache, in the background, so many
        reads are in flight at once. Returns how many were hinted (0: all were cached).

        A record counts as cached when the page of its middle byte is: its first and last
        pages may be shared with its neighbours."""
        hinted = 0
        for fd, offset, length in self.record_extents(np.asarray(indexes, dtype=np.int64)):
            if not cached(fd, offset + length // 2):
                will_need(fd, offset, length)
                hinted += 1
        return hinted

    def record_extents(self, indexes: np.ndarray):
        """(descriptor, file offset, length) of each record in indexes that is one run in a
        file; records the layout cannot place that way are left out (their hints are skipped)."""
        return ()

    def positions_of(self, indexes: np.ndarray) -> np.ndarray:
        """Where records `indexes` are stored (vectorised position())."""
        table = self.position_table()
        return indexes if table is False else table[indexes]

    def __len__(self) -> int:
        return self.count

    def where(self, index: int) -> str:
        return f"{self.path} record {self.split}/{index}"

    def check_index(self, index: int) -> None:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for split {self.split!r} of {self.count} records")

    def read(self, index: int) -> tuple[bytes, int, str]:
        """(image bytes, label, relative path) of record index."""
        data, label = self.read_image(index)
        return data, label, self.paths[index]

    def read_image(self, index: int) -> tuple[bytes, int]:
        """(image bytes, label) of record index: what a Dataset needs for each item. The
        path is left out (read() adds it): decoding it would cost every read."""
        if self.remote is None:
            return self.read_record(index)
        return self.read_record_refetched(index)

    def read_record(self, index: int) -> tuple[bytes, int]:
        """read_image's read of the record, checked (check_data): the format's layout."""
        raise NotImplementedError

    def check_data(self, data: bytes, crc: int | None, index: int) -> None:
        """Raise if check_crc is on and data does not match the checksum stored with it
        (of the pack's kind, Metadata.checksum).

        The message (record, path) is only formatted on a mismatch: reads are hot."""
        if self.check_crc and self.record_digest(data) & MASK != crc:
            self.checksum_mismatch(index)

    def checksum_mismatch(self, index: int):
        raise CorruptDataError(f"{self.where(index)} ({self.paths[index]}): checksum mismatch, the stored image is "
                               f"damaged (its {self.metadata.checksum} differs from the one stored; run packer "
                               "verify; re-pack from the source)", self.path)
