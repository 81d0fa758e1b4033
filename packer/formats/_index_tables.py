"""The tables a pack stores so that a reader builds nothing per record: each path's offset in
the path table (`path_offsets`) and each record's stored position (`positions`, the inverse of a
shuffled pack's `order`). The writer works them out a chunk at a time; a reader maps them and
checks each block of READ_BLOCK entries on its first use (PathIndex, position_checks), the
tables' CRC-32s in check_tables (packer verify). Where positions is stored, it also proves
order a permutation without a byte a record (order_inverted_by). Packs written before them
build both in memory, as they did (4 bytes a record each)."""
from __future__ import annotations

import numpy as np

from ..errors import CorruptDataError
from ..records import PathSequence, PathTable, path_offsets
from ._tables import DAMAGED, SPILL_BLOCK, BlockChecks, array_chunks, blocks, check_count, drop_pages, drop_part

OFFSET = np.dtype("<u8")  # a path_offsets entry
POSITION = np.dtype("<i4")  # a positions entry, as order's
# Entries of the inverse made per pass over order: 16 MB of output a pass, so a pack of 10^8
# records makes it in 25 passes and never holds more than this.
INVERSE_WINDOW = 1 << 22
# Entries of order checked per pass of order_inverted_by: 36 KB of scratch a pass, whatever
# the count (10^8 records: 24,000 passes, a fraction of the time the gather's misses take).
INVERSE_CHECK_BLOCK = 1 << 12


def path_offset_chunks(paths: PathTable, size: int = SPILL_BLOCK):
    """The path_offsets table of paths, as stored, in chunks: path i is the NUL-joined table's
    bytes [offsets[i], offsets[i + 1] - 1), offsets[0] = 0, offsets[count] = its size + 1 (an
    empty table: the one entry 0)."""
    first = paths.offsets.item(0)
    for chunk in array_chunks(paths.offsets, size):  # a mapped table's pages dropped as it goes
        yield (chunk.astype(np.int64) - first).astype(OFFSET)


def inverse_chunks(order: np.ndarray, window: int = INVERSE_WINDOW):
    """The positions table of a storage order (positions[order[j]] = j), as stored, a window at a
    time: one pass over order per window, so neither is ever whole in memory."""
    count = len(order)
    for low in range(0, count, window):
        high = min(count, low + window)
        out = np.empty(high - low, POSITION)
        for start, stop in blocks(count, SPILL_BLOCK):
            at = order[start:stop]
            mine = (at >= low) & (at < high)
            out[at[mine] - low] = np.flatnonzero(mine) + start
            drop_part(order, start, stop)  # a mapped order's pages out of RSS as the pass goes
        drop_pages(order)
        yield out


def stored_positions(positions: np.ndarray | None, order: np.ndarray | None, where: str, path: str) -> tuple | None:
    """A Reader's stored_positions: (positions, position_checks), or None where the split stores no
    positions; a positions table without the order table it inverts is damage."""
    if positions is None:
        return None
    if order is None:
        raise CorruptDataError(f"{where}: a positions table in a split stored in index order (no order table); "
                               f"{DAMAGED}", path)
    return positions, position_checks(positions, order, where, path)


def order_inverted_by(order: np.ndarray, positions: np.ndarray) -> bool:
    """Whether positions[order[i]] == i for every i, each order entry in range: then order is a
    permutation (two equal entries would map back to one i) and positions its inverse. A block
    at a time, both tables mapped: no scratch per record, where is_permutation keeps a byte."""
    count = len(order)
    if len(positions) != count:
        return False
    for start, stop in blocks(count, INVERSE_CHECK_BLOCK):
        part = order[start:stop]
        if int(part.min()) < 0 or int(part.max()) >= count:
            return False
        if not np.array_equal(positions[part], np.arange(start, stop, dtype=np.int32)):
            return False
    return True


def position_checks(positions: np.ndarray, order: np.ndarray, where: str, path: str) -> BlockChecks:
    """BlockChecks of a mapped positions table against the mapped order it inverts: each
    entry names a position of the split, and order names the entry's record there. A read
    finds its record's position once that block passed, so a damaged entry never reads
    another record (whose own checksum would pass); the tables' CRC-32s are check_tables'."""
    count = len(order)
    check_count(len(positions), count, where)

    def check(start: int, stop: int) -> None:  # a closure, not a method: no reference cycle
        part = positions[start:stop]
        if not len(part):
            return
        if int(part.min()) < 0 or int(part.max()) >= count:
            raise CorruptDataError(f"{where}: entries {start}..{stop} name positions outside 0..{count - 1}; "
                                   f"{DAMAGED}", path)
        if not np.array_equal(order[part], np.arange(start, stop)):
            raise CorruptDataError(f"{where}: entries {start}..{stop} are not the inverse of the order table; "
                                   f"{DAMAGED}", path)
    return BlockChecks(count, check)


def offsets_of(found: tuple, where: str, path: str) -> np.ndarray:
    """A stored path_offsets table, found as (buffer, start, length), as its entries (mapped)."""
    buffer, start, length = found
    if length % OFFSET.itemsize:
        raise CorruptDataError(f"{where}: {length} bytes, not a whole number of {OFFSET.itemsize}-byte "
                               f"entries; {DAMAGED}", path)
    return np.frombuffer(buffer, OFFSET, length // OFFSET.itemsize, start)


class PathIndex(PathSequence):
    """The path table read through its stored offsets, both mapped: path i without scanning the
    table for NULs or holding an offset per path. Each block of READ_BLOCK paths is checked on
    its first use: its offsets must be where the table's NULs are, and each path safe."""

    __slots__ = ("data", "start", "size", "offsets", "checks", "where", "path")

    def __init__(self, data, start: int, size: int, offsets: np.ndarray, count: int, where: str, path: str):
        self.data, self.start, self.size = data, start, size  # the table's bytes: data[start:start + size]
        self.offsets, self.where, self.path = offsets, where, path
        check_count(len(offsets), count + 1, where)
        if offsets.item(0) != 0 or offsets.item(count) != (size + 1 if count else 0):
            raise CorruptDataError(f"{where}: does not describe the {size}-byte path table; {DAMAGED}", path)
        self.checks = BlockChecks(count, self.check_block)

    def check_block(self, first: int, last: int) -> None:
        low, high = self.offsets.item(first), self.offsets.item(last)
        if not 0 <= low < high <= self.size + 1:
            raise CorruptDataError(f"{self.where}: entries {first}..{last} do not rise within the "
                                   f"{self.size}-byte path table; {DAMAGED}", self.path)
        found = PathTable.from_nul_separated(self.data, self.where, self.start + low, high - 1 - low)
        stored = self.offsets[first:last + 1].astype(np.int64)
        if len(found) != last - first or not np.array_equal(found.offsets.astype(np.int64) - self.start, stored):
            raise CorruptDataError(f"{self.where}: entries {first}..{last} are not where the path table's "
                                   f"paths start; {DAMAGED}", self.path)

    def raw(self, i: int) -> bytes:
        checks = self.checks
        if checks.left:  # once every block has passed, no call
            checks.ensure(i)
        return self.data[self.start + self.offsets.item(i):self.start + self.offsets.item(i + 1) - 1]

    def __len__(self) -> int:
        return self.checks.count

    def __reduce__(self):
        # A map cannot be pickled: a PathIndex pickles as the whole table's bytes (a PathTable).
        return PathTable.from_nul_separated, (bytes(self.data[self.start:self.start + self.size]), self.where)

    def length(self, i: int) -> int:
        checks = self.checks
        if checks.left:  # once every block has passed, no call
            checks.ensure(i)
        return self.offsets.item(i + 1) - self.offsets.item(i) - 1

    def lengths(self, indexes: np.ndarray) -> np.ndarray:
        """Each path's length in bytes (int64), vectorised."""
        self.checks.ensure_all(indexes)
        return self.offsets[indexes + 1].astype(np.int64) - self.offsets[indexes].astype(np.int64) - 1

    def check_every(self) -> None:
        self.checks.ensure_every()


class IndexedPaths:
    """A SplitReader's paths by index, looked up through the path_offsets the pack stores
    (a format adds stored_path_offsets and mapped_paths), else from the whole path table."""

    _path_index: PathIndex | bool | None = None  # path_index(): False where the pack stores no path offsets

    def path_of(self, index: int) -> str:
        """Record index's relative path (index in range): looked up through the stored path
        offsets (path_index) where the pack has them, else from the path table (paths)."""
        found = self.path_index() if self._path_index is None else self._path_index
        return self.paths[index] if found is False else found[index]

    def path_raw(self, index: int) -> bytes:
        """path_of's path as stored (UTF-8 bytes)."""
        found = self.path_index() if self._path_index is None else self._path_index
        return self.paths.raw(index) if found is False else found.raw(index)

    def path_lookup(self):
        """Every record's path by index (what Dataset.paths hands out): the path table read
        through its stored offsets (PathIndex: nothing per record, each block checked on first
        use) where the pack has them, else the path table (paths: its offsets found by
        scanning it, 4 bytes a record)."""
        found = self.path_index()
        return self.paths if found is False else found

    def path_index(self) -> PathIndex | bool:
        """The path table read through its stored offsets (PathIndex), loaded once; False in a
        pack written before path_offsets, or at a URL (its path table is read whole)."""
        if self._path_index is None:
            found = self.loaded("path index", self.load_path_index)
            self._path_index = False if found is None else found
        return self._path_index

    def load_path_index(self) -> PathIndex | None:
        if self.remote is not None:
            return None
        found = self.stored_path_offsets()
        if found is None:
            return None
        offsets, where = found
        return PathIndex(*self.mapped_paths(), offsets, self.count, where, self.path)

    def stored_path_offsets(self) -> tuple | None:
        """(the path_offsets table as stored, mapped and unchecked, where it is), or None where
        the pack stores none (the layout's; none here)."""
        return None

    def mapped_paths(self) -> tuple:
        """The path table as stored, mapped and unchecked, as (buffer, start, length) (the layout's)."""
        raise NotImplementedError

    def check_path_index(self) -> None:
        """Every block of the stored path offsets (check_layout_tables), where there are some."""
        if self.path_index() is not False:
            self._path_index.check_every()
