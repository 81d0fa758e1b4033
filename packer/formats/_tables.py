"""Per-record tables as read from a file: their CRC-32s, their range checks and the file's identity.

Every table a reader loads (labels, paths, offsets, extents, order, records) is untrusted
input: it is checked once, when it loads, vectorised, so that reads need no checks of
their own. Packs written by this packer carry a CRC-32 of each table (each format's
docstring says where); packs written before carry none and are only range-checked.

Tables are mapped from the dataset's file (map_region, mapped_array), not read into each
process: at a million records they are tens of MB, and a copy per process would be one
per DataLoader worker per rank. Mapped read-only, their pages are the page cache's, shared
by every process that reads the dataset, and the checks at load (CRC-32 included) only
read them, so they stay shared. A mapped file must not shrink while in use (touching a page
past its end kills the process with SIGBUS): packed data is never rewritten in place, and
a re-pack (--force) writes a new file, leaving the old one whole for readers that map it.

Writers keep their per-record rows out of memory the same way (SpillTable, spilled_array):
appended to an unlinked file in the output's folder as records arrive, written into the
pack a chunk at a time when the split ends. A mapped table's pages count in the RSS of the
process that touched them until it drops them (drop_pages), as pack does as it goes.
"""
from __future__ import annotations

import json
import mmap
import os
import tempfile

import numpy as np


from ..crc import crc32
from ..errors import CorruptDataError, FormatError, ReplacedError

DAMAGED = "the dataset is damaged: restore it from a copy or re-pack it"
# Entries checked per numpy pass: keeps each check's temporaries well under a MB, so a large
# table's checks leave no freed heap behind in the process (glibc keeps freed blocks of the
# sizes it has recently seen on the heap instead of giving them back).
CHECK_BLOCK = 1 << 14


def blocks(count: int, size: int = CHECK_BLOCK):
    """(start, stop) of each block of at most size entries of count."""
    return ((start, min(count, start + size)) for start in range(0, count, size))


# Entries one range check of a read covers (BlockChecks): a few pages of each table (8 KB of
# offsets, 4 KB of labels, 28 KB of WebDataset records), so that a read at random into a
# table of 10^8 entries maps about what it uses, not 16 times that.
READ_BLOCK = 1 << 10


class BlockChecks:
    """Which blocks of READ_BLOCK entries of a mapped table have passed their range check,
    each checked on its first use (check(start, stop) raises if entries [start, stop) are
    out of range): opening a table of 10^8 entries then reads none of it, and a read checks
    the block around its own. One bit per block (a 10^9-entry table: 122 KB).

    `left` counts the blocks not checked yet: a hot read tests it before it calls ensure,
    so once every block has passed (soon, reading at random) a read pays no call for it."""

    __slots__ = ("checked", "check", "count", "left")

    def __init__(self, count: int, check):
        self.checked = bytearray(-(-count // (READ_BLOCK * 8)))
        self.check = check
        self.count = count
        self.left = -(-count // READ_BLOCK)

    def ensure(self, i: int) -> None:
        """Check the block of entry i unless it has been (a damaged block raises at every use)."""
        block = i // READ_BLOCK
        if not self.checked[block >> 3] >> (block & 7) & 1:
            self.check(block * READ_BLOCK, min(self.count, (block + 1) * READ_BLOCK))
            self.checked[block >> 3] |= 1 << (block & 7)
            self.left -= 1

    def ensure_every(self) -> None:
        """Check the whole table (check_tables), CHECK_BLOCK entries a pass: few passes."""
        for start, stop in blocks(self.count):
            self.check(start, stop)
        self.checked[:] = b"\xff" * len(self.checked)
        self.left = 0

    def ensure_all(self, entries: np.ndarray) -> None:
        """Check the blocks of every entry in entries (vectorised ensure)."""
        for block in np.unique(np.asarray(entries, np.int64) // READ_BLOCK).tolist():
            self.ensure(block * READ_BLOCK)


def offsets_check(offsets: np.ndarray, size: int, where: str, path: str):
    """check(start, stop) for BlockChecks: raise unless offsets[start..stop] rise within [0,
    size] (each block takes the next one's first entry, so every pair is compared once)."""
    def check(start: int, stop: int) -> None:  # a closure, not a method: no reference cycle
        part = offsets[start:stop + 1]
        if int(part.min()) < 0 or int(part.max()) > size or bool((part[1:] < part[:-1]).any()):
            raise CorruptDataError(f"{where}: entries {start}..{stop} do not describe the {size} bytes they index "
                                   f"(each within them, none below the one before); {DAMAGED}", path)
    return check


def checked_whole(start: int, stop: int) -> None:
    """BlockChecks' check for a table already checked whole (read whole at a URL): none left."""


def is_permutation(order: np.ndarray) -> bool:
    """Whether order holds each of 0..len(order)-1 exactly once: all in range and none missing
    (then none repeats). One byte of scratch per entry."""
    seen = np.zeros(len(order), bool)
    for start, stop in blocks(len(order)):
        part = order[start:stop]
        if int(part.min()) < 0 or int(part.max()) >= len(order):
            return False
        seen[part] = True
    return bool(seen.all())


def table_crc(raw) -> int:
    """CRC-32 (zlib) of a table's bytes as stored (bytes, or any contiguous buffer: a mapped table)."""
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


# A mapped table up to this size is still CRC-checked whole when a reader opens it (tens of ms,
# ImageNet-21k's tables and below), so no flipped byte of it is ever read back; a larger one is
# range-checked a block at a time as reads use it, and CRC-checked whole by check_tables (packer
# verify): opening 10^8 records must not read gigabytes first (docs/safety.md).
CRC_AT_OPEN = 64 << 20


def crc_now(nbytes: int) -> bool:
    """Whether a mapped table of nbytes is CRC-checked when it is opened (CRC_AT_OPEN)."""
    return nbytes <= CRC_AT_OPEN


def check_crc(raw, expected: int | None, where: str) -> None:
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


def check_within(offset: np.ndarray, length: np.ndarray, size, where: str, what: str,
                 size_of: np.ndarray | None = None) -> None:
    """Every [offset, offset + length) within [0, size) (size: one, or one per entry, or
    with size_of given, size[size_of[i]] for entry i), computed without overflowing uint64,
    a block at a time."""
    sizes = np.asarray(size)
    for start, stop in blocks(len(offset)):
        at, n = offset[start:stop].astype(np.uint64), length[start:stop].astype(np.uint64)
        limit = sizes if sizes.ndim == 0 else sizes[size_of[start:stop]] if size_of is not None \
            else sizes[start:stop]
        limit = np.broadcast_to(limit.astype(np.uint64), at.shape)
        bad = (n > limit) | (at > limit - np.minimum(n, limit))
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise CorruptDataError(f"{where}: {what} {start + first} lies at bytes {int(at[first])}..+{int(n[first])}, "
                                   f"past the end of its {int(limit[first])}-byte file; {DAMAGED}", where)


def map_region(fd: int, offset: int, length: int, where: str) -> tuple[mmap.mmap | bytes, int]:
    """(a read-only map of the file's bytes [offset, offset + length), where they start in
    it), checked to lie within the file; (b"", 0) for no bytes.

    The map starts at the page holding offset, so the start within it is below a page."""
    if length <= 0:
        return b"", 0
    size = os.fstat(fd).st_size
    if offset < 0 or offset + length > size:
        raise CorruptDataError(f"{where}: a table at bytes {offset}..+{length} lies past the end of the "
                               f"{size}-byte file (truncated?); {DAMAGED}", where)
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        region = mmap.mmap(fd, length + offset - aligned, access=mmap.ACCESS_READ, offset=aligned)
    except (OSError, ValueError) as exc:
        raise CorruptDataError(f"{where}: cannot map the table ({exc}); {DAMAGED}", where) from exc
    return region, offset - aligned


def mapped_array(fd: int, offset: int, count: int, dtype, where: str) -> np.ndarray:
    """count entries of dtype at the file's byte offset, mapped read-only (map_region)."""
    dtype = np.dtype(dtype)
    region, start = map_region(fd, offset, count * dtype.itemsize, where)
    return np.frombuffer(region, dtype, count, start)


def int_view(values: np.ndarray):
    """A 1-D integer table indexed as Python ints for a read's hot path: a memoryview of it
    (no copy), whose [i] costs a third of ndarray.item(i). A memoryview indexes only the
    machine's own byte order, under its plain format letter: a table stored in the other
    order is converted once, and the view is cast to that letter ("I", not "<I")."""
    values = np.ascontiguousarray(values, values.dtype.newbyteorder("="))
    return memoryview(values).cast("B").cast(values.dtype.char)


def buffer_of(values: np.ndarray) -> tuple:
    """(a buffer that slices to bytes, where values' bytes start in it): the map a mapped
    uint8 table lies in, or else a copy of its bytes."""
    region = values.base.obj if isinstance(values.base, memoryview) else values.base  # frombuffer's view
    if isinstance(region, mmap.mmap) and values.size:
        return region, values.ctypes.data - np.frombuffer(region, np.uint8).ctypes.data
    return values.tobytes(), 0


def region_view(region, start: int, length: int) -> memoryview:
    """The bytes [start, start + length) of a mapped region, not copied (for CRC-32s)."""
    return memoryview(region)[start:start + length]


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


def replaced_error(what: str) -> ReplacedError:
    return ReplacedError(f"{what} was replaced since this Dataset was created (re-create the Dataset / "
                            "restart the DataLoader)", what)


# ------------------------------------------------------------------ spilled tables (writers)

# Rows a spill table buffers before appending them to its file, and rows read back per chunk:
# a few MB at most, whatever the record count.
SPILL_BLOCK = 1 << 16


class SpillTable:
    """A per-record table a writer fills as records arrive, kept in an unlinked file (in the
    output's staging folder) instead of memory, and read back a chunk at a time.

    At a million records a writer's tables (extents, sizes, CRCs) are tens of MB; held
    whole, the packer's memory would grow with the dataset. Rows go to a small buffer,
    appended to the file when it fills; the file has no name (O_TMPFILE where the OS has
    it), so an interrupted pack leaves nothing behind."""

    def __init__(self, dtype, folder: str, block: int = SPILL_BLOCK):
        self.dtype = np.dtype(dtype)
        self.file = tempfile.TemporaryFile(dir=folder)
        self.buffer = np.empty(block, self.dtype)
        self.filled = 0  # rows in the buffer
        self.count = 0   # rows appended in all

    def __len__(self) -> int:
        return self.count

    def append(self, row) -> None:
        """One row: a value, or a tuple of the fields' values for a structured dtype."""
        self.buffer[self.filled] = row
        self.filled += 1
        self.count += 1
        if self.filled == len(self.buffer):
            self.flush()

    def extend(self, rows: np.ndarray) -> None:
        """Many rows at once (a chunk of a table worked out whole)."""
        self.flush()
        self.file.write(memoryview(np.ascontiguousarray(rows, self.dtype)).cast("B"))
        self.count += len(rows)

    def flush(self) -> None:
        if self.filled:
            self.file.write(memoryview(self.buffer[:self.filled]).cast("B"))
            self.filled = 0
        self.file.flush()  # to the file itself, where chunks() and map() read it

    def chunks(self, size: int = SPILL_BLOCK):
        """The rows in order, as arrays of at most size rows (each a new array: read, not mapped)."""
        self.flush()
        for start in range(0, self.count, size):
            rows = np.empty(min(size, self.count - start), self.dtype)
            got = os.preadv(self.file.fileno(), [memoryview(rows).cast("B")], start * self.dtype.itemsize)
            if got != rows.nbytes:
                raise OSError(f"spilled table: read {got} of {rows.nbytes} bytes")
            yield rows

    def chunks_in(self, order: np.ndarray, size: int = 2 * SPILL_BLOCK):
        """The rows rearranged so that row j lands at position order[j] (order: a permutation),
        as arrays of at most size rows in position order: one pass over the file per output
        chunk, a chunk of each in memory at a time, not the whole table."""
        for low in range(0, self.count, size):
            high = min(self.count, low + size)
            out = np.empty(high - low, self.dtype)
            start = 0
            for rows in self.chunks():
                at = order[start:start + len(rows)]
                mine = (at >= low) & (at < high)
                out[at[mine] - low] = rows[mine]
                drop_part(order, start, start + len(rows))
                start += len(rows)
            drop_pages(order)
            yield out

    def map(self):
        """The whole table's bytes as a read-only map of its file (b"" when empty), for a writer
        that must hand its store one buffer; drop_pages(it) after use."""
        self.flush()
        if not self.count:
            return b""
        return mmap.mmap(self.file.fileno(), self.count * self.dtype.itemsize, access=mmap.ACCESS_READ)

    def close(self) -> None:
        self.file.close()


def spilled_array(values: np.ndarray, folder: str | None) -> np.ndarray:
    """values moved to an unlinked file in folder and mapped read-only from it (values
    itself with no folder, or when empty): a per-record array that is only read from now
    on, out of the heap. Its reader drops the pages it touched now and then (drop_pages)."""
    if folder is None or not values.size:
        return values
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(memoryview(np.ascontiguousarray(values)).cast("B"))
            f.flush()
            region = mmap.mmap(f.fileno(), values.nbytes, access=mmap.ACCESS_READ)
    except OSError:  # a folder we cannot write to (the write itself then says so, clearly): kept in memory
        return values
    return np.frombuffer(region, values.dtype, values.size).reshape(values.shape)


def drop_pages(buffer) -> None:
    """Drop a file map's pages from this process's resident memory (madvise MADV_DONTNEED):
    they stay in the page cache and fault back in if touched, but no longer count in RSS. A
    no-op for anything but an mmap (or an array mapped by spilled_array or mapped_array), or
    where madvise is unavailable."""
    if isinstance(buffer, np.ndarray):
        buffer = mapped_region(buffer)
    if isinstance(buffer, mmap.mmap) and len(buffer) and hasattr(mmap, "MADV_DONTNEED"):
        buffer.madvise(mmap.MADV_DONTNEED)


def drop_part(values: np.ndarray, start: int, stop: int) -> None:
    """drop_pages for entries [start, stop) of a 1-D array mapped from a file alone (the whole
    pages they touch, whose neighbours in the same map fault back in if used): a pass over a
    table of GBs keeps a block of it resident, not the whole. A no-op as drop_pages is."""
    region = mapped_region(values)
    if region is None or stop <= start or not hasattr(mmap, "MADV_DONTNEED"):
        return
    low = values[start:stop].ctypes.data - np.frombuffer(region, np.uint8).ctypes.data
    high = min(len(region), low + (stop - start) * values.itemsize)
    low -= low % mmap.PAGESIZE
    region.madvise(mmap.MADV_DONTNEED, low, high - low)


def mapped_region(values: np.ndarray):
    """The mmap a numpy array (or its view) was made from with frombuffer, or None."""
    base = values
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def array_chunks(values: np.ndarray, size: int = SPILL_BLOCK):
    """values in slices of at most size entries, the pages of a mapped array dropped after each."""
    for start in range(0, len(values), size):
        yield values[start:start + size]
        drop_pages(values)


def nul_separated_chunks(paths, size: int = 1 << 20):
    """A PathTable's on-disk form (packer.records: paths joined by NUL) in pieces of about size
    bytes, each a new bytes object, so that a table mapped from a spill file is written out
    without being read into memory whole; the map's pages are dropped as it goes."""
    if not len(paths):
        return
    low, high = paths.offsets.item(0), paths.offsets.item(len(paths)) - 1
    for start in range(low, high, size):
        yield bytes(paths.data[start:min(high, start + size)])
        drop_pages(paths.data)


def nul_separated_view(paths):
    """A path table's on-disk form (NUL-joined) as a view of its buffer, not a copy."""
    if not len(paths):
        return b""
    return memoryview(paths.data)[paths.offsets.item(0):paths.offsets.item(len(paths)) - 1]
