"""The files of the dataset a Reader reads, each opened and checked to be of the dataset it read
the metadata of (its identity: _tables.file_identity locally, the object's ETag, size and
modification time at a URL): the data file, shards and tables in files of their own, and the
one handle a process shares per dataset file (_handle)."""
from __future__ import annotations

import functools
import os

from ..errors import CorruptDataError
from ..remote import source as remote_source
from . import _handle
from ._io import open_for_reading
from ._tables import (DAMAGED, check_crc, crc_now, expected_crc, fd_identity, file_identity, map_region, region_view,
                      replaced_error)


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


class DatasetFiles:
    """A SplitReader's opening of its dataset's files (it sets path, identity_file, identity,
    access, and remote at a URL; table_checksums() gives the tables' CRC-32s)."""

    remote = None  # packer.remote.source.Remote where the dataset is a URL
    # Whether a local reader maps its tables from the data file handle()[2] (check_not_cut).
    MAPS_DATA_FILE = False

    def check_identity(self, identity: tuple | None = None) -> None:
        """Raise if the dataset was replaced at its path since this reader read its metadata
        (identity: of a file just opened; else the file now at the path)."""
        now = identity if identity is not None else current_identity(self.identity_file, self.remote)
        if now != self.identity:
            raise replaced_error(self.identity_file)

    @property
    def may_be_cut(self) -> bool:
        """Whether check_not_cut checks anything: a local reader that maps its tables from its
        data file. A Dataset asks once, so that a read of the others pays no call."""
        return self.MAPS_DATA_FILE and self.remote is None

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
