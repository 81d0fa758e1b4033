"""Reading an LMDB pack's records at their extents, one pread each, instead of through LMDB's
map (packer.formats.lmdb's docstring says why): the extents and sums tables, the header checks
that tell extents gone stale (a database rewritten by another tool) from a damaged record, and
the page hints that extents make possible. HEADER is the record header those reads skip or
check; EXTENT an entry of the extents table."""
from __future__ import annotations

import struct
import warnings

import numpy as np

from . import _io
from ._tables import READ_BLOCK, BlockChecks, check_within, int_view

HEADER = struct.Struct("<IiH")  # checksum, label, path length: the start of every record value
EXTENT = np.dtype([("offset", "<u8"), ("length", "<u4")])


class ExtentReads:
    """An LMDB Reader's reads at extents (the Reader gives handle(), table(), table_where() and
    the SplitReader's labels, paths, positions and loaded tables)."""

    _extents: np.ndarray | None | bool = None  # False: none stored, or found stale
    _extent_at = _extent_length = None  # the extents' fields, looked up once per read
    _extent_blocks = None  # the extents' BlockChecks: each block within data.mdb, on first use
    _sums: memoryview | None | bool = None  # False: none stored

    def read_at_extent(self, position: int, index: int) -> tuple[bytes, int | None] | None:
        """(image bytes, the checksum to check them against: None with check_crc off) of the
        record at position by pread of its extent, or None where there is none.

        The image is read straight into the bytes returned (slicing it out of the whole
        value would cost a second copy, a quarter of a warm read), from past the header
        and path, whose length the path table gives. Its checksum comes from the sums
        table: a checked read is one pread, like an unchecked one (a check that fails has
        read_image look at the header, check_extent_header). In a pack without sums, with
        check_crc on, the header and path are read too: they end where the image starts
        and share its first page (a value in overflow pages starts 16 bytes into one), so
        that read is served from the page cache, and a header that does not name record
        index means the extents are stale: they are dropped.
        """
        if self._extents is None:
            self.extents()
        if self._extents is False:
            return None
        checks = self._extent_blocks
        if checks.left:  # once every block has passed, no call
            checks.ensure(position)
        at = self._extent_at.item(position)
        if not at:
            return None
        head = HEADER.size + self.path_length(index)
        length = self._extent_length.item(position) - head
        if length < 0:  # too short to hold its header: the map read reports the damage
            return None
        fd = self.handle()[2]
        if self.remote is not None and self.check_crc:
            return self.read_whole_value(fd, at + head, length, index)
        data = _io.pread(fd, length, at + head)
        if len(data) < length:
            self.check_not_cut()
        if len(data) == length:
            if not self.check_crc:
                return data, None
            sums = self._sums if self._sums is not None else self.record_sums()
            if sums is not False:
                return data, sums[position]
            crc = self._header_crc(fd, at, index, self.path_raw(index))
            if crc is not None:
                return data, crc
        self.drop_extents()
        return None

    def check_extent_header(self, position: int, index: int) -> None:
        """After a record read at its extent failed its check: drop the extents if the
        header there does not name record index (they are stale, the database was
        rewritten); if it does, the record itself is damaged, which the map read reports."""
        if self._header_crc(self.handle()[2], self._extent_at.item(position), index,
                            self.path_raw(index)) is None:
            self.drop_extents()

    def record_sums(self) -> memoryview | bool:
        """The sums table (uint32 by position, as an int_view), loaded and checked once;
        False in a pack written before it."""
        if self._sums is None:
            found = self.loaded("sums", self.load_sums)
            self._sums = False if found is None else found
        return self._sums

    def load_sums(self) -> memoryview | None:
        found = self.table(b"sums", required=False, crc=False)
        return None if found is None else int_view(self.entries_of(found, "<u4", self.table_where(b"sums")))

    def read_whole_value(self, fd, at: int, length: int, index: int) -> tuple[bytes, int] | None:
        """read_at_extent for a remote dataset: header, path and image in one ranged read
        (two reads would be two round trips to the server)."""
        relpath = self.path_raw(index)
        start = at - HEADER.size - len(relpath)
        value = _io.pread(fd, at + length - start, start) if start >= 0 else b""
        crc = self.header_crc(value[:at - start], index, relpath) if len(value) == at + length - start else None
        if crc is None:
            self.drop_extents()
            return None
        return value[at - start:], crc

    def _header_crc(self, fd: int, offset: int, index: int, relpath: bytes) -> int | None:
        """The checksum in the header at offset if that header names record index, else None."""
        if offset < 0:
            return None
        return self.header_crc(_io.pread(fd, HEADER.size + len(relpath), offset), index, relpath)

    def header_crc(self, header: bytes, index: int, relpath: bytes) -> int | None:
        """The checksum in a record's header (with its path) if it names record index, else None."""
        if len(header) != HEADER.size + len(relpath):
            return None
        crc, label, n = HEADER.unpack_from(header)
        if n != len(relpath) or label != self.label(index) or header[HEADER.size:] != relpath:
            return None
        return crc

    def drop_extents(self) -> None:
        warnings.warn(f"{self.path}: the stored record extents do not match the records (the database was "
                      "rewritten by another tool, e.g. mdb_copy -c); reading through LMDB's map instead, "
                      "which is slower from a cold cache. Re-pack or `packer convert` it to restore them",
                      RuntimeWarning, stacklevel=4)
        self._extents = False

    def extents(self) -> np.ndarray | None:
        if self._extents is None:
            found = self.loaded("extents", self.load_extents) if _io.CAN_PREAD else None
            if found is None:
                self._extents = False
            else:
                extents, self._extent_blocks = found
                # Views of the (mapped) table, one per field: a read looks up each once.
                self._extent_at, self._extent_length = extents["offset"], extents["length"]
                self._extents = extents
                # A remote read with check_crc checks each header it reads (read_whole_value):
                # spot checks would cost a block fetch each, before the first read.
                if not (self.remote is not None and self.check_crc) and not self._spot_check_extents():
                    self.drop_extents()
        return None if self._extents is False else self._extents

    def load_extents(self) -> tuple | None:
        """(the extents table, mapped, and its BlockChecks: each block's extents within
        data.mdb, checked on its first use): one entry per record."""
        found = self.table(b"extents", required=False, crc=False)
        if found is None:
            return None
        where = self.table_where(b"extents")
        extents = self.entries_of(found, EXTENT, where)
        size = _io.file_size(self.handle()[2])

        def check(start: int, stop: int) -> None:  # not a method: the reader holds it, so no cycle
            check_within(extents["offset"][start:stop], extents["length"][start:stop], size, where, "extent")
        return extents, BlockChecks(self.count, check)

    def path_length(self, index: int) -> int:
        """Record index's path length in bytes: what its header holds before the image."""
        found = self.path_index() if self._path_index is None else self._path_index
        if found is not False:
            return found.length(index)
        offsets = self.paths.offsets
        return offsets.item(index + 1) - offsets.item(index) - 1

    def _spot_check_extents(self, samples: int = 8) -> bool:
        """Whether the headers at a few extents, spread over the split, name their records.

        A rewritten database (mdb_copy -c) moves every value, so a few checks catch it
        before any read relies on extents without reading headers (check_crc off)."""
        fd = self.handle()[2]
        for index in np.unique(np.linspace(0, self.count - 1, min(samples, self.count)).astype(int)).tolist():
            position = self.position(index)
            self._extent_blocks.ensure(position)
            at = self._extent_at.item(position)
            if at and self._header_crc(fd, at, index, self.path_raw(index)) is None:
                return False
        return True


    def will_need(self, start: int, stop: int) -> None:
        extents = self.extents()
        if extents is None or start >= stop:
            return
        self._extent_blocks.ensure_all(np.append(np.arange(start, stop, READ_BLOCK), stop - 1))
        chunk = extents[start:stop]
        chunk = chunk[chunk["length"] > 0]
        if len(chunk):
            first = int(chunk["offset"].min())
            _io.will_need_uncached(self.handle()[2], first, int((chunk["offset"] + chunk["length"]).max()) - first)

    def record_extents(self, indexes: np.ndarray):
        if self.extents() is None or not len(indexes):
            return ()
        positions = self.positions_of(indexes)
        self._extent_blocks.ensure_all(positions)
        head = HEADER.size + self.path_lengths(indexes)
        extent = self._extent_at[positions].astype(np.int64)
        at, length = extent + head, self._extent_length[positions].astype(np.int64) - head
        keep = (extent > 0) & (length >= 0)  # values in leaf pages have no extent
        fd = self.handle()[2]
        return ((fd, a, n) for a, n in zip(at[keep].tolist(), length[keep].tolist()))

