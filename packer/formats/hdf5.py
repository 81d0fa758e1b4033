"""HDF5: one file holding every split, each as a contiguous byte blob plus index arrays.

  /                      attrs: packer_metadata  UTF-8 JSON (packer.records.Metadata)
                                classes          class names, variable-length UTF-8 strings
  /<split>/images        uint8[total bytes]   every record's original file bytes, back to back
  /<split>/offsets       int64[count + 1]     the record at position j is images[offsets[j]:offsets[j + 1]]
  /<split>/crc32         uint32[count]        the checksum of the record at position j, of the kind
                                              the metadata's "checksum" names (packer.checksum;
                                              CRC-32 (zlib) where absent: the dataset's name is
                                              kept for every kind, so the layout is unchanged)
  /<split>/labels        int32[count]         label of record i (-1 = unlabeled)
  /<split>/paths         uint8[n]             relative paths of records 0..count-1, UTF-8,
                                              "/"-separated, joined by NUL
  /<split>/path_offsets  uint64[count + 1]    path i is paths[offsets[i]:offsets[i + 1] - 1]
                                              (offsets[0] = 0, offsets[count] = n + 1; an empty
                                              split: the one entry 0); missing in packs written
                                              before it, whose readers find the offsets by
                                              scanning paths for NULs (4 bytes a record)
  /<split>/order         int32[count]         only in shuffled packs: the record stored at position j
  /<split>/positions     int32[count]         only in shuffled packs: the position record i is stored
                                              at (order's inverse: positions[order[j]] = j); missing
                                              in packs written before it, whose readers work it out
                                              from order (4 bytes a record in each process)
  /<split>               attrs: checksums     UTF-8 JSON {table: CRC-32 (zlib)} of the little-endian
                                              bytes of each table above but images ("offsets",
                                              "crc32", "labels", "paths", "path_offsets", "order"
                                              and "positions" where stored);
                                              missing in packs written before table checksums,
                                              whose tables are then only range-checked

A record's index i is its ImageFolder rank; its position j is where it is stored. They are
the same (and there is no order dataset) unless the pack was shuffled (--shuffle-seed).
All numbers are little-endian.

Why a blob and not a variable-length dataset: h5py refuses variable-length byte strings
that contain NUL (JPEGs are full of them), and a vlen uint8 dataset goes through a heap
pointer per record on every read (several times slower random reads: docs/formats.md),
while a record of the blob is one slice. Paths are a NUL-joined blob for the same reason,
the same encoding as LMDB's.

Why chunks of 256 KiB: `images` grows while packing, and HDF5 can only resize a chunked
dataset. Readers open the file with the chunk cache off (rdcc_nbytes=0): chunks that are
neither cached nor filtered are read directly, exactly the selected bytes, with one read
per chunk an image touches.
256 KiB keeps that to one or two reads for typical ~110 KB JPEGs and the chunk index at 4
entries per MB, while a reader that keeps h5py's default chunk cache (8 MiB in HDF5 2.0)
reads whole chunks, several times the bytes it needs (more with larger chunks). No
compression: JPEG does not compress, and a filter would force whole-chunk reads. Written
with libver ("v110", "v110"): the newer chunk indexes, readable by any HDF5 >= 1.10.

packer's own Reader goes one step further: it asks HDF5 once where each chunk of `images`
lies in the file and then reads a record with one pread per run of adjacent chunks (one
or two), skipping h5py's per-call overhead (most of a warm read) and reading
exactly the record's bytes. A file whose chunks are filtered (rewritten by another tool)
is read through h5py instead.

The per-record tables are written whole when a split ends, so HDF5 stores each contiguous
(only images is chunked) and a reader maps them from the file where HDF5 says they start
(Dataset.id.get_offset), instead of copying them into each process (_tables). A table
stored otherwise (chunked, as packs before this were written for offsets and crc32, or in
another byte order) is read into memory as before.

Opening checks each table's length and ends, and that images is stored whole in the
file (HDF5 makes up zeros for a sparse dataset's unwritten bytes); a read range-checks the
block of offsets and labels it uses on first use, and check_tables (verify) checks every
table whole with its CRC-32 (docs/safety.md). Readers are tied to the file they read the
metadata of (inode, size, mtime: _tables.file_identity): a file replaced at its path while
in use (pack --force) is refused by a reader created before, in any process that opens it
afresh, rather than mixed with the old one.

A file named by URL (`https://host/imagenet.h5`) is opened by h5py as a Python file
object over a packer.remote byte source (its metadata reads come from cached blocks),
and records are read at the chunk map's offsets by ranged reads, as locally.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os

import h5py
import numpy as np

from ..checksum import MASK
from ..crc import crc32
from ..errors import CorruptDataError, FormatError
from ..records import Metadata, PathTable, check_split_name, encode_path
from ..remote import source as remote_source
from . import _handle, _io
from ._contract import Format
from ._foreign import listing
from ._index_tables import OFFSET, inverse_chunks, path_offset_chunks, stored_positions
from ._hdf5_file import HDF5_SIGNATURE, HDF5File, close_file, open_file, open_remote_file
from ._reader import SplitReader
from ._tables import (DAMAGED, BlockChecks, SpillTable, array_chunks, buffer_of, check_count, check_crc, crc_now,
                      dataset_identity, decode_checksums, encode_checksums, expected_crc, int_view, mapped_array,
                      nul_separated_chunks, offsets_check)

EXTENSION = ".h5"
DIRECTORY = False
META_ATTR = "packer_metadata"
# What packer writes in the file: --force replaces one holding nothing else (foreign).
ROOT_ATTRS = {META_ATTR, "classes"}
TABLES = {"images", "offsets", "crc32", "labels", "paths", "path_offsets", "order", "positions"}
CHECKSUMS_ATTR = "checksums"
CHUNK_BYTES = 256 << 10
# What the writer keeps of each record until its split ends (spilled, not in memory): where
# it ends in images and its CRC-32.
SPILLED_ROW = np.dtype([("end", "<i8"), ("crc", "<u4")])
FLUSH_BYTES = 16 << 20  # image bytes buffered between writes (peak memory ~2x this): large writes
# Records buffered at most: a buffered record costs ~50 bytes besides its own, so records of a
# few bytes would otherwise hold ~10x FLUSH_BYTES before a write.
FLUSH_RECORDS = 1 << 16
LIBVER = ("v110", "v110")


def detect(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE


class Writer:
    """Streams each split's bytes into a resizable dataset, one large write per FLUSH_BYTES;
    the per-record tables (compact arrays meanwhile) are written whole when the split ends."""

    def __init__(self, stage: str, options: dict):
        self.stage = stage
        # No chunk cache here either: every write reaches the file when it is made, so a full
        # disk fails that write, cleanly. With a cache the failure surfaces when HDF5 evicts
        # or closes, and closing a file whose flush failed crashes HDF5 (segfault, HDF5 2.0).
        self.file = h5py.File(stage, "w", libver=LIBVER, locking=False, rdcc_nbytes=0)
        self.group: h5py.Group | None = None
        self.buffer: list[bytes] = []
        self.buffered = 0
        self.rows: SpillTable | None = None  # each record's end in images and CRC, spilled (begin_split)
        self.size = 0  # bytes of the current split, written or buffered

    def begin_split(self, split: str, expected_count: int | None = None) -> None:
        check_split_name(split)
        g = self.group = self.file.create_group(split)
        g.create_dataset("images", shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(CHUNK_BYTES,))
        self.size = 0
        self.rows = SpillTable(SPILLED_ROW, os.path.dirname(os.path.abspath(self.stage)))

    def add(self, data: bytes, label: int, relpath: str, crc: int) -> None:
        self.buffer.append(data)
        self.buffered += len(data)
        self.size += len(data)
        self.rows.append((self.size, crc))
        if self.buffered >= FLUSH_BYTES or len(self.buffer) >= FLUSH_RECORDS:
            self.flush()

    def end_split(self, labels: np.ndarray, paths: PathTable, order: np.ndarray | None = None) -> None:
        """Write the split's tables; order[j] is the ImageFolder rank of the j-th added record."""
        self.flush()
        count = len(self.rows)
        table_crcs = {
            # Written a chunk at a time from the spilled rows: never whole in memory.
            "offsets": write_table(self.group, "offsets", "<i8", count + 1, itertools.chain(
                [np.zeros(1, "<i8")], (rows["end"] for rows in self.rows.chunks()))),
            "crc32": write_table(self.group, "crc32", "<u4", count, (rows["crc"] for rows in self.rows.chunks())),
            "labels": write_table(self.group, "labels", "<i4", len(labels), array_chunks(labels)),
            "paths": write_table(self.group, "paths", np.uint8, paths_bytes(paths),
                                 (np.frombuffer(piece, np.uint8) for piece in nul_separated_chunks(paths))),
            "path_offsets": write_table(self.group, "path_offsets", OFFSET, len(paths) + 1, path_offset_chunks(paths)),
        }
        self.rows.close()
        if order is not None:
            table_crcs["order"] = write_table(self.group, "order", "<i4", len(order), array_chunks(order))
            table_crcs["positions"] = write_table(self.group, "positions", "<i4", len(order), inverse_chunks(order))
        self.group.attrs.create(CHECKSUMS_ATTR, encode_checksums(table_crcs).decode(),
                                dtype=h5py.string_dtype("utf-8"))
        self.group = self.rows = None

    def finish(self, meta: Metadata) -> None:
        # Written as bytes: a class name that is not valid UTF-8 (possible on Linux) is kept
        # byte for byte, and h5py reads it back with surrogate escapes, as packer encodes paths.
        text = h5py.string_dtype("utf-8")
        self.file.attrs.create(META_ATTR, meta.to_json(), dtype=text)
        self.file.attrs.create("classes", np.array([encode_path(c) for c in meta.classes], dtype=object),
                               dtype=text)
        self.file.close()
        with open(self.stage, "rb") as f:  # on disk before it is published
            os.fsync(f.fileno())

    def abort(self) -> None:
        # The staging file is deleted next; after a failed write HDF5 cannot flush it and
        # says so here, which must not hide the error that got us here.
        with contextlib.suppress(Exception):
            self.file.close()

    def flush(self) -> None:
        if not self.buffer:
            return
        append(self.group["images"], np.frombuffer(b"".join(self.buffer), np.uint8))
        self.buffer, self.buffered = [], 0


def write_table(group: h5py.Group, name: str, dtype, count: int, chunks) -> int:
    """A contiguous dataset (readers map it) of count entries written from chunks (arrays,
    in order, as many entries as count in all); its CRC-32, over the entries as stored."""
    dataset = group.create_dataset(name, shape=(count,), dtype=dtype)
    value, at = 0, 0
    for chunk in chunks:
        chunk = np.ascontiguousarray(chunk, dtype)  # the stored byte order, so the CRC is of the stored bytes
        if not len(chunk):
            continue
        dataset[at:at + len(chunk)] = chunk
        value = crc32(chunk, value)
        at += len(chunk)
    if at != count:
        raise ValueError(f"{name}: {at} entries written, {count} expected")
    return value


def paths_bytes(paths: PathTable) -> int:
    """The size of a path table's on-disk form."""
    return paths.offsets.item(len(paths)) - 1 - paths.offsets.item(0) if len(paths) else 0


def append(dataset: h5py.Dataset, values: np.ndarray) -> None:
    n = dataset.shape[0]
    dataset.resize((n + len(values),))
    dataset[n:] = values


def remote_metadata(url: str, remote) -> tuple[tuple, Metadata]:
    """(identity, Metadata) of the HDF5 dataset at url."""
    identity = remote_source.dataset_object_identity(remote, url, url, "no such file")
    with open_remote_file(remote.open(url, identity)) as f:
        return identity, metadata_of(f, url)


def read_metadata(path: str, identity: tuple | None = None) -> Metadata:
    identity = identity or dataset_identity(path)
    with _handle.borrowed(path, functools.partial(open_file, identity=identity), close_file, identity) as f:
        return metadata_of(f, path)


def metadata_of(f: h5py.File, path: str) -> Metadata:
    try:
        raw = f.attrs.get(META_ATTR)
    except OSError as exc:
        raise CorruptDataError(f"{path}: cannot read the {META_ATTR!r} attribute ({exc}); the file is "
                               "damaged, re-pack it", path) from exc
    if raw is None:
        raise FormatError(f"{path}: HDF5 file without packer metadata (no {META_ATTR!r} attribute); "
                          "an interrupted pack never publishes, so this was not written by packer pack", path)
    return Metadata.from_json(raw, path)


class Reader(HDF5File, SplitReader):
    """Random access to one split's records; safe to pickle and to use after fork.

    The h5py file and a plain descriptor for preads (HDF5File) are opened on first access in each
    process (never used across fork) and dropped on pickle. The per-record tables are
    mapped from the file (module docstring); the chunk map is small (one entry per
    CHUNK_BYTES of images), and where a record lies in the file is worked out from it
    as the record is read, not kept in a table per record.

    path may be a URL; storage_options, cache_dir, cache_limit and block_size then say
    how to read it (packer.remote.source.Remote); its tables are then read into memory.
    """

    TABLES = {"_offsets": None, "_offset_blocks": None, "_crcs": None, "_chunks": None, "_breaks": None}
    MAPS_DATA_FILE = True

    def __init__(self, path: str, split: str | None = None, check_crc: bool = True, **remote):
        remote = remote_source.remote_for(path, **remote)
        if remote is None:
            if not detect(path):
                raise FormatError(f"{path}: not an HDF5 file", path)
            path = os.path.abspath(path)
            identity = dataset_identity(path)
            super().__init__(path, split, check_crc, read_metadata(path, identity), path, identity)
        else:
            identity, metadata = remote_metadata(path, remote)
            super().__init__(path, split, check_crc, metadata, path, identity)
            self.read_remotely(remote)
        self._offsets: np.ndarray | None = None
        self._offset_blocks: BlockChecks | None = None  # offsets' range checks, a block at a time
        self._crcs: memoryview | None = None
        self._chunks: np.ndarray | None | bool = None  # False: read through h5py

    def table_checksums(self) -> dict | None:
        def load():
            try:
                raw = self.handle()[0][self.split].attrs.get(CHECKSUMS_ATTR)
            except (KeyError, OSError, ValueError, TypeError) as exc:
                raise CorruptDataError(f"{self.table_where('')}: unreadable attributes ({exc}); {DAMAGED}",
                                       self.path) from exc
            return decode_checksums(raw, f"{self.table_where('')} attribute {CHECKSUMS_ATTR}")
        return self.loaded(CHECKSUMS_ATTR, load)

    def table_where(self, name: str) -> str:
        return f"{self.path} dataset {self.split}/{name}"

    def _array(self, name: str, length: int, dtype: str, required: bool = True,
               crc: bool = True) -> np.ndarray | None:
        """Table split/name as dtype, checked: its CRC-32 where the pack has checksums (with
        crc; a table read rather than mapped always), and length entries (length < 0: any
        number). Mapped where it is stored contiguous in dtype's byte order (stored_table),
        else read."""
        f, crcs, where = self.handle()[0], self.table_checksums(), self.table_where(name)
        try:
            if not required and name not in f[self.split] and (crcs is None or name not in crcs):
                return None
            dataset = f[self.split][name]
            if not isinstance(dataset, h5py.Dataset) or dataset.ndim != 1:
                raise KeyError("not a one-dimensional dataset")
            values = None if self.remote is not None else stored_table(dataset, np.dtype(dtype), self.handle()[2],
                                                                       where)
            if values is None:
                values, crc = np.ascontiguousarray(dataset[()], dtype=dtype), True
        except (KeyError, OSError, ValueError, TypeError) as exc:
            raise CorruptDataError(f"{where}: cannot read it ({exc}); {DAMAGED}", self.path) from exc
        expected = expected_crc(crcs, name, where)
        if crc or crc_now(values.nbytes):
            check_crc(values, expected, where)
        if length >= 0:
            check_count(values.size, length, where)
        return values

    def index(self) -> tuple[np.ndarray, memoryview]:
        """(offsets, crcs (an int_view)) of this split by position, mapped once. Callers
        check the offsets they use first (self._offset_blocks.ensure)."""
        if self._offsets is None:
            self._crcs, self._offsets, self._offset_blocks = self.loaded("index", self.load_index)
        return self._offsets, self._crcs

    def load_index(self) -> tuple[memoryview, np.ndarray, BlockChecks]:
        """(crcs, offsets, their BlockChecks), mapped and checked at their ends: offsets run
        from 0 to the size of images, whose bytes are all stored, in the file; each block
        rises within [0, size], checked on its first use. The tables' CRC-32s are left to
        check_layout_tables: a damaged crc32 entry fails its record's read, never passes it."""
        offsets, where = self._array("offsets", self.count + 1, "<i8", crc=False), self.table_where("offsets")
        size = self.check_images()
        if offsets[0] != 0 or offsets[-1] != size:
            raise CorruptDataError(f"{where}: does not describe the {size}-byte images dataset; {DAMAGED}", self.path)
        crcs = int_view(self._array("crc32", self.count, "<u4", crc=False))
        return crcs, offsets, BlockChecks(self.count, offsets_check(offsets, size, where, self.path))

    def check_layout_tables(self) -> None:
        """The offsets and crc32 tables' CRC-32s, and every block of offsets (load_index)."""
        self._array("offsets", self.count + 1, "<i8")
        self._array("crc32", self.count, "<u4")
        self.index()
        self._offset_blocks.ensure_every()
        self._array("path_offsets", self.count + 1, OFFSET, required=False)
        self.check_path_index()
        if self._array("positions", self.count, "<i4", required=False) is not None:
            self.storage_order()  # order's CRC-32, and a permutation: positions, checked below, is its inverse
            self.position_table()
            self._position_checks.ensure_every()

    def stored_path_offsets(self) -> tuple | None:
        offsets = self._array("path_offsets", self.count + 1, OFFSET, required=False, crc=False)
        return None if offsets is None else (offsets, self.table_where("path_offsets"))

    def mapped_paths(self) -> tuple:
        values = self._array("paths", -1, np.uint8, crc=False)
        return (*buffer_of(values), values.size)

    def stored_positions(self) -> tuple | None:
        positions = self._array("positions", self.count, "<i4", required=False, crc=False)
        order = None if positions is None else self._array("order", self.count, "<i4", required=False, crc=False)
        return stored_positions(positions, order, self.table_where("positions"), self.path)

    def check_images(self) -> int:
        """The size of images, checked to be stored whole in the file: HDF5 makes up zeros
        for the bytes of a dataset that were never written (a sparse dataset)."""
        images, where = self.handle()[1], self.table_where("images")
        try:
            size, stored = images.shape[0], images.id.get_storage_size()
            filtered = bool(images.id.get_create_plist().get_nfilters())
            chunks = images.chunks
            allocated = images.id.get_num_chunks() if chunks else None
        except (OSError, ValueError, TypeError, IndexError) as exc:
            raise CorruptDataError(f"{where}: cannot read its layout ({exc}); {DAMAGED}", self.path) from exc
        if size != self.metadata.splits[self.split].bytes:
            raise CorruptDataError(f"{where}: {size} bytes, the metadata says the split's images take "
                                   f"{self.metadata.splits[self.split].bytes}; {DAMAGED}", self.path)
        whole = (-(-size // chunks[0]) == allocated) if chunks else stored >= size
        if not whole or (not filtered and stored < size):
            raise CorruptDataError(f"{where}: {size} bytes, of which the file stores only part ({stored} bytes "
                                   f"allocated); {DAMAGED}", self.path)
        if not filtered and stored > _io.file_size(self.handle()[2]):
            raise CorruptDataError(f"{where}: larger than the file that holds it (truncated?); {DAMAGED}",
                                   self.path)
        return size

    def chunks(self) -> np.ndarray | None:
        """File offset of each CHUNK_BYTES chunk of images, or None to read through h5py."""
        if self._chunks is None:
            self.index()  # images checked first: its size sizes the map
            chunks = chunk_map(self.handle()[1]) if _io.CAN_PREAD else None
            if chunks is None:
                self._chunks = False
            else:
                # breaks[k]: how many of chunks 1..k do not follow the one before in the file
                # (HDF5 puts metadata between a few): a record is one run in the file when
                # the chunks it spans have the same count.
                self._breaks = np.concatenate(([0], np.cumsum(np.diff(chunks) != CHUNK_BYTES)))
                self._chunks = chunks
        return None if self._chunks is False else self._chunks

    def file_offsets(self, positions: np.ndarray | None = None) -> np.ndarray | None:
        """Where each record stored at positions (default: all) starts in the file, -1 for
        those that cross from one chunk to another stored elsewhere; None to read through
        h5py. Worked out on request (read_image does the same for one record)."""
        chunks = self.chunks()
        if chunks is None:
            return None
        offsets, _ = self.index()
        if positions is None:
            self._offset_blocks.ensure_every()
            starts, stops = offsets[:-1], offsets[1:]
        else:
            self._offset_blocks.ensure_all(positions)
            starts, stops = offsets[positions], offsets[positions + 1]
        first, last = starts // CHUNK_BYTES, np.maximum(stops - 1, starts) // CHUNK_BYTES
        first, last = np.minimum(first, len(chunks) - 1), np.minimum(last, len(chunks) - 1)
        one_run = self._breaks[last] == self._breaks[first]
        return np.where(one_run, chunks[first] + starts - first * CHUNK_BYTES, -1)

    def read_record(self, index: int) -> tuple[bytes, int]:
        self.check_index(index)
        offsets, crcs = self.index()
        position = self.position(index)
        if self._offset_blocks.left:  # a block not checked yet: this one, maybe
            self._offset_blocks.ensure(position)
        start, stop = offsets.item(position), offsets.item(position + 1)
        chunks = self.chunks()
        if chunks is None:
            data = read_bytes(self.handle()[1], start, stop, self.where(index))
        else:
            first, last = start // CHUNK_BYTES, (stop - 1) // CHUNK_BYTES
            if stop <= start:
                data = b""
            elif last == first or self._breaks.item(last) == self._breaks.item(first):  # one run: one pread
                data = _io.pread(self.handle()[2], stop - start, chunks.item(first) + start - first * CHUNK_BYTES)
            else:
                data = read_extent(self.handle()[2], chunks, start, stop)
            if data is None or len(data) != stop - start:
                raise CorruptDataError(f"{self.where(index)}: the file ends inside the record; it was truncated "
                                       "(re-pack it, or restore it from a copy)", self.path)
        # The checksum table is only touched when checking: a random read's every table lookup is a
        # cache miss. check_data, inlined: a Python call less per read.
        if self.check_crc and self.record_digest(data) & MASK != crcs[position]:
            self.checksum_mismatch(index)
        return data, self.label(index)

    def load_tables(self) -> None:
        self.index()
        self.chunks()

    def read_order(self) -> np.ndarray | None:
        order = self.loaded("order", lambda: self._array("order", self.count, "<i4", required=False))
        return None if order is None else self.checked_order(order)

    def will_need(self, start: int, stop: int) -> None:
        chunks = self.chunks()
        if chunks is None or start >= stop:
            return
        offsets, _ = self.index()
        self._offset_blocks.ensure_all((start, stop - 1))  # the blocks of offsets[start] and offsets[stop]
        first, last = int(offsets[start]) // CHUNK_BYTES, (int(offsets[stop]) - 1) // CHUNK_BYTES
        if last >= first:
            lo, hi = int(chunks[first:last + 1].min()), int(chunks[first:last + 1].max()) + CHUNK_BYTES
            _io.will_need_uncached(self.handle()[2], lo, hi - lo)

    def record_extents(self, indexes: np.ndarray):
        if self.chunks() is None or not len(indexes):
            return ()
        offsets, _ = self.index()
        positions = self.positions_of(indexes)
        self._offset_blocks.ensure_all(positions)
        at, size = self.file_offsets(positions), offsets[positions + 1] - offsets[positions]
        keep = at >= 0
        fd = self.handle()[2]
        return ((fd, a, n) for a, n in zip(at[keep].tolist(), size[keep].tolist()))

    def load_labels(self) -> np.ndarray:
        labels = np.asarray(self._array("labels", self.count, "<i4"), np.int32)  # no copy: it stays mapped
        return self.checked_labels(labels, self.table_where("labels"))

    def map_labels(self) -> tuple[np.ndarray, str]:
        return self._array("labels", self.count, "<i4", crc=False), self.table_where("labels")

    def load_paths(self) -> PathTable:
        values = self._array("paths", -1, np.uint8)
        buffer, start = buffer_of(values)
        table = PathTable.from_nul_separated(buffer, self.table_where("paths"), start, values.size)
        check_count(len(table), self.count, self.table_where("paths"), "paths")
        return table


def stored_table(dataset: h5py.Dataset, dtype: np.dtype, fd: int, where: str) -> np.ndarray | None:
    """dataset's values mapped from the file (fd), when it is stored contiguous, unfiltered and
    in dtype exactly (byte order included); else None (read it instead, as for a URL: a
    remote file has no map)."""
    try:
        offset = dataset.id.get_offset()
        stored = dataset.id.get_storage_size()
    except (OSError, ValueError, TypeError):
        return None
    count = dataset.shape[0]
    if offset is None or dataset.dtype != dtype or stored != count * dtype.itemsize or not count:
        return None
    return mapped_array(fd, offset, count, dtype, where)


def chunk_map(images: h5py.Dataset) -> np.ndarray | None:
    """File offset of every chunk of images, when each is stored whole and unfiltered; else None."""
    if images.chunks != (CHUNK_BYTES,) or images.compression is not None:
        return None
    n = -(-images.shape[0] // CHUNK_BYTES)
    found = np.full(n, -1, np.int64)
    dsid = images.id
    try:
        def note(info):
            if info.filter_mask == 0 and info.size == CHUNK_BYTES:
                found[info.chunk_offset[0] // CHUNK_BYTES] = info.byte_offset
        if hasattr(dsid, "chunk_iter"):  # HDF5 >= 1.14: one pass over the chunk index
            dsid.chunk_iter(note)
        else:
            for k in range(dsid.get_num_chunks()):
                note(dsid.get_chunk_info(k))
    except (OSError, ValueError, RuntimeError):
        return None
    return found if n and (found >= 0).all() else None


def read_extent(fd: int, chunks: np.ndarray, start: int, stop: int) -> bytes | None:
    """images[start:stop] by pread: one read per run of chunks that lie back to back in the
    file; None if the file ends first."""
    parts = []
    k = start // CHUNK_BYTES
    while start < stop:
        first = chunks.item(k)
        run_start = first + start - k * CHUNK_BYTES
        end = min(stop, (k + 1) * CHUNK_BYTES)
        while end < stop and chunks.item(k + 1) == chunks.item(k) + CHUNK_BYTES:
            k += 1
            end = min(stop, (k + 1) * CHUNK_BYTES)
        part = _io.pread(fd, end - start, run_start)
        if len(part) != end - start:
            return None
        parts.append(part)
        start, k = end, k + 1
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_bytes(images: h5py.Dataset, start: int, stop: int, where: str) -> bytes:
    """images[start:stop]. Plain slicing: h5py's fast path for simple slices measured faster
    than building the hyperslab through the low-level API."""
    try:
        return images[start:stop].tobytes()
    except (OSError, ValueError) as exc:
        raise CorruptDataError(f"{where}: cannot read the stored bytes ({exc}); the file is damaged "
                               "(run packer verify; re-pack from the source)", where) from exc


def read_remote(url: str, remote) -> tuple[Metadata, set[str]]:
    """(Metadata, no names) of the HDF5 dataset at url: it is the one object OUT, nothing under it."""
    return remote_metadata(url, remote)[1], set()


def foreign(path: str, meta: Metadata) -> str | None:
    """Anything in a packer HDF5 file beyond its attributes and its splits' tables."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            extra = [f"attribute {name}" for name in f.attrs if name not in ROOT_ATTRS]
            for name, member in f.items():
                if name not in meta.splits or not isinstance(member, h5py.Group):
                    extra.append(f"/{name}")
                    continue
                extra += [f"/{name}/{table}" for table in member if table not in TABLES]
    except (OSError, ValueError) as exc:
        return f"is an HDF5 file that cannot be read whole ({exc})"
    if extra:
        return f"is an HDF5 file holding {listing(extra)}, which packer does not write"
    return None


FORMAT = Format(name="hdf5", aliases=("h5", "hdf"), extension=EXTENSION, directory=DIRECTORY, Writer=Writer,
                Reader=Reader, detect=detect, read_metadata=read_metadata, title="HDF5", held_as="an HDF5 file",
                signature=HDF5_SIGNATURE, read_remote=read_remote, foreign=foreign)
