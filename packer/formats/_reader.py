"""The common ground of every format's Reader: split choice, count, CRC policy, record names,
access pattern, page hints and storage order. What it reads through lives beside it: the
dataset's files, checked to be of the dataset it read (_dataset_files), and its labels and
paths tables, loaded (and checked) once (_lazy_tables).

A dataset named by URL (s3://, gs://, https://) is read through packer.remote: its
descriptors are byte sources that _io serves like file descriptors, its identity is the
object's (ETag, size, modification time), and a record that fails its check is read once
more past the cache before the damage is reported (read_record_refetched)."""
from __future__ import annotations

import os

import numpy as np

from .. import checksum as record_checksums
from ..checksum import MASK
from ..errors import CorruptDataError
from ..remote import source as remote_source
from ..records import Metadata, choose_split
from ._contract import check_format_named
from ._dataset_files import DatasetFiles
from ._handle import LazyHandle
from ._index_tables import IndexedPaths, order_inverted_by
from ._io import cached, check_access, will_need
from ._lazy_tables import LazyTables
from ._tables import is_permutation


_UNREAD = object()


class SplitReader(IndexedPaths, DatasetFiles, LazyTables, LazyHandle):
    """One split of a packed dataset. Subclasses add the layout: _open/_close and
    read_record(i), and read_order() where records may be stored out of index order.

    Tables are loaded in each process that reads (mapped from the dataset's file where the
    layout allows, see _tables): pickling leaves them out, so a Dataset sent to a spawned
    worker or another rank carries its paths and counts, not tens of MB of tables."""

    _order = _UNREAD  # storage_order(), read once
    # index -> stored position, mapped from the pack (stored_positions) or built from
    # storage_order(); False: the index itself
    _position: np.ndarray | bool | None = None
    _position_checks = None  # a mapped positions table's BlockChecks (None: built, or none)
    # Whether read_image finds a record by its stored position (open() builds that table).
    reads_by_position = True
    # The attributes that hold loaded tables, with their values before loading: pickling
    # resets them (subclasses add their own).
    TABLES: dict = {}
    # The registry, packer.formats.FORMATS, handed over when packer.formats is imported (it sits
    # above this module): the formats a metadata's format may name.
    formats: dict = {}

    def __init__(self, path: str, split: str | None, check_crc: bool, metadata: Metadata,
                 identity_file: str | None = None, identity: tuple | None = None):
        self.path = path if remote_source.is_url(path) else os.path.abspath(path)
        check_format_named(metadata, self.path, self.formats)
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
        for name in ("_order", "_position", "_position_checks", "_path_index", "_label_blocks", "_labels", "_paths"):
            state.pop(name, None)  # this process's maps: each process loads its own
        return state

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
        """Index -> stored position: the pack's positions table, mapped, each block range-checked
        on first use (position, positions_of); in packs without one, built once from
        storage_order(), 4 bytes a record; False: the index itself."""
        if self._position is None:
            stored = self.loaded("positions", self.stored_positions)
            if stored is not None:
                self._position, self._position_checks = stored
                return self._position
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
        if table is False:
            return index
        checks = self._position_checks
        if checks is not None and checks.left:  # once every block has passed, no call
            checks.ensure(index)
        return table.item(index)

    def stored_positions(self) -> tuple | None:
        """(the positions table as stored, mapped, and its BlockChecks), or None where the pack
        stores none (the layout's; none here)."""
        return None

    def checked_order(self, order: np.ndarray) -> np.ndarray:
        """A stored order table, checked to be a permutation of the records; int32, kept as
        it is when it is already (a mapped table stays mapped)."""
        order = np.asarray(order, np.int32)
        if len(order) != self.count or not self.is_permutation(order):
            raise CorruptDataError(f"{self.path}: the {self.split} order table is not a permutation of "
                                   f"{self.count} records; the dataset is damaged, re-pack it", self.path)
        return order

    def is_permutation(self, order: np.ndarray) -> bool:
        """Whether order holds each record once: where the pack stores positions, proved by
        positions[order[i]] == i (order_inverted_by: nothing per record); else, or where that
        fails (to tell a damaged order from a damaged positions table, whose block checks name
        it), with a byte a record of scratch (_tables.is_permutation)."""
        stored = self.loaded("positions", self.stored_positions)
        if stored is not None and order_inverted_by(order, stored[0]):
            return True
        return is_permutation(order)

    def will_need(self, start: int, stop: int) -> None:
        """Hint that the records stored at positions [start, stop) are read soon, as one span
        of each file, unless its pages are found cached (_io.will_need_uncached); no-op here."""

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
        if table is False:
            return indexes
        if self._position_checks is not None:
            self._position_checks.ensure_all(indexes)
        return table[indexes]

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
        return data, label, self.path_of(index)

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
        raise CorruptDataError(f"{self.where(index)} ({self.path_of(index)}): checksum mismatch, the stored image is "
                               f"damaged (its {self.metadata.checksum} differs from the one stored; run packer "
                               "verify; re-pack from the source)", self.path)
