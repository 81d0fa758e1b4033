"""A read-only LMDB lookup over a byte source: LMDB's B-tree walked by ranged reads.

LMDB itself needs a memory map of the whole file; a remote data.mdb is read page by page
instead. A local reader finds where its tables lie the same way (locate, over FileSource):
a value looked up through LMDB (py-lmdb's get, even as a buffer) has every page of it
faulted in, seconds for the tables of 10^8 records. Only the pages on the path to a key are fetched: the meta pages, one page per
tree level, and a value's overflow pages. The layout (LMDB 0.9, 64-bit, little-endian;
lmdb's mdb.c defines it):

  page header, 16 bytes: uint64 page number, uint16 pad, uint16 flags (0x01 branch,
      0x02 leaf, 0x04 overflow, 0x08 meta, 0x20 leaf2), then either uint16 lower, uint16
      upper (branch, leaf: the node pointer array ends at lower) or uint32 the number of
      pages (overflow: the value follows the header, across that many pages)
  node pointers: uint16 each from byte 16 to lower, the offset of each node in its page,
      in key order
  node: uint16 lo, uint16 hi, uint16 flags, uint16 key size, the key, then
      leaf: the value (lo | hi << 16 bytes), or with flag 0x01 (big data) the uint64 page
            number of its first overflow page
      branch: no value; the child's page number is lo | hi << 16 | flags << 32, and the
            first node's key is empty (it covers everything below the second)
  meta pages 0 and 1: MDB_meta after the header: uint32 magic, uint32 version, 8 bytes
      address, 8 bytes map size, two 48-byte database records (free DB, main DB: uint32
      pad, uint16 flags, uint16 depth, uint64 branch, leaf and overflow page counts,
      uint64 entries, uint64 root page), uint64 last page, uint64 txnid. The page size is
      the free DB's pad; the newer meta page (higher txnid) is the database.

Every number read is checked against the page size and the file (depth, node offsets,
key and value lengths, page numbers), so a damaged or crafted file gives a
CorruptDataError, never a read outside it or an endless walk.
"""
from __future__ import annotations

import os
import struct

from ..errors import CorruptDataError

PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
OVERFLOW_PAGES = struct.Struct("<I")  # at byte 12 of an overflow page
NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
META = struct.Struct("<II8x8x 48s 48s QQ")  # magic, version, address, mapsize, free DB, main DB, last page, txnid
DB = struct.Struct("<IHH QQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MAGIC, VERSION = 0xBEEFC0DE, 1
HEADER_SIZE = 16
NO_PAGE = (1 << 64) - 1
MAX_DEPTH = 32
DAMAGED = "restore it from a copy or re-pack"


class FileSource:
    """A local descriptor as LMDBPages' byte source."""

    def __init__(self, fd: int):
        self.fd, self.size = fd, os.fstat(fd).st_size

    def pread(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)


class LMDBPages:
    """get(key) -> value bytes or None, and locate(key) -> where a value in overflow pages lies,
    over source (pread(size, offset), size)."""

    def __init__(self, source, where: str):
        self.source, self.where = source, where
        self.page_size, self.last_page, self.root, self.depth = self.read_meta()

    def damaged(self, what: str) -> CorruptDataError:
        return CorruptDataError(f"{self.where}: {what}; the LMDB database is damaged, {DAMAGED}", self.where)

    def read_meta(self) -> tuple[int, int, int, int]:
        """(page size, last page, main DB root, depth) from the newer meta page."""
        first = self.meta_at(0)
        second = self.meta_at(first[0])
        page_size, last_page, root, depth, _ = max(first, second, key=lambda meta: meta[4])
        if (last_page + 1) * page_size > self.source.size:
            raise self.damaged(f"truncated: {self.source.size} bytes, the database needs "
                               f"{(last_page + 1) * page_size}")
        return page_size, last_page, root, depth

    def meta_at(self, offset: int) -> tuple[int, int, int, int, int]:
        raw = self.source.pread(HEADER_SIZE + META.size, offset)
        if len(raw) < HEADER_SIZE + META.size:
            raise self.damaged("too short to hold LMDB's meta pages")
        flags = PAGE_HEADER.unpack_from(raw)[2]
        magic, version, free_db, main_db, last_page, txnid = META.unpack_from(raw, HEADER_SIZE)
        page_size = DB.unpack(free_db)[0]
        _, _, depth, _, _, _, _, root = DB.unpack(main_db)
        if not flags & P_META or magic != MAGIC or version != VERSION or not 512 <= page_size <= 65536 \
                or page_size & (page_size - 1) or last_page < 1:
            raise self.damaged(f"not a readable LMDB meta page at byte {offset}")
        if depth > MAX_DEPTH or (root != NO_PAGE and not 2 <= root <= last_page):
            raise self.damaged(f"the meta page at byte {offset} names root page {root} at depth {depth}")
        return page_size, last_page, root, depth, txnid

    def page(self, number: int) -> bytes:
        if not 2 <= number <= self.last_page:
            raise self.damaged(f"a node points to page {number}, outside pages 2..{self.last_page}")
        raw = self.source.pread(self.page_size, number * self.page_size)
        if len(raw) != self.page_size:
            raise self.damaged(f"page {number} is cut short")
        return raw

    def nodes(self, page: bytes, number: int) -> list[int]:
        """The offsets of a branch or leaf page's nodes, checked to lie within it."""
        lower, upper = PAGE_HEADER.unpack_from(page)[3:5]
        if lower < HEADER_SIZE or lower > upper or upper > self.page_size or (lower - HEADER_SIZE) % 2:
            raise self.damaged(f"page {number} has a bad header (lower {lower}, upper {upper})")
        count = (lower - HEADER_SIZE) // 2
        offsets = struct.unpack_from(f"<{count}H", page, HEADER_SIZE)
        for offset in offsets:
            if offset < upper or offset + NODE.size > self.page_size:
                raise self.damaged(f"page {number} has a node at byte {offset}, outside its node area")
        return list(offsets)

    def key_at(self, page: bytes, offset: int, number: int) -> tuple[int, int, int, bytes]:
        lo, hi, flags, key_size = NODE.unpack_from(page, offset)
        start = offset + NODE.size
        if start + key_size > self.page_size:
            raise self.damaged(f"page {number} has a key running past its end")
        return lo, hi, flags, page[start:start + key_size]

    def get(self, key: bytes) -> bytes | None:
        """The value stored under key in the main database, or None."""
        found = self.find(key)
        return None if found is None else self.value(*found)

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """(file offset, size) of key's value where it fills overflow pages, read by no one;
        None where key is missing or its value sits in its leaf page."""
        found = self.find(key)
        if found is None or not found[3] & F_BIGDATA:
            return None
        return self.overflow(*found), found[2]

    def find(self, key: bytes) -> tuple | None:
        """Key's leaf node as value() takes it, or None."""
        number = self.root
        if number == NO_PAGE:
            return None
        for _ in range(MAX_DEPTH + 1):
            page = self.page(number)
            flags = PAGE_HEADER.unpack_from(page)[2]
            if flags & P_BRANCH:
                number = self.child(page, number, key)
            elif flags & P_LEAF and not flags & P_LEAF2:
                return self.leaf_node(page, number, key)
            else:
                raise self.damaged(f"page {number} (flags {flags:#x}) is neither a branch nor a leaf page")
        raise self.damaged(f"the tree is deeper than {MAX_DEPTH} levels (a loop?)")

    def child(self, page: bytes, number: int, key: bytes) -> int:
        """The child of a branch page whose range holds key (binary search; node 0 is the lowest)."""
        offsets = self.nodes(page, number)
        if not offsets:
            raise self.damaged(f"branch page {number} is empty")
        low, high = 1, len(offsets) - 1
        chosen = 0
        while low <= high:
            middle = (low + high) // 2
            if self.key_at(page, offsets[middle], number)[3] <= key:
                chosen, low = middle, middle + 1
            else:
                high = middle - 1
        lo, hi, flags, _ = self.key_at(page, offsets[chosen], number)
        return lo | hi << 16 | flags << 32

    def leaf_node(self, page: bytes, number: int, key: bytes) -> tuple | None:
        offsets = self.nodes(page, number)
        low, high = 0, len(offsets) - 1
        while low <= high:
            middle = (low + high) // 2
            lo, hi, flags, found = self.key_at(page, offsets[middle], number)
            if found == key:
                return page, offsets[middle], lo | hi << 16, flags, len(found), number
            if found < key:
                low = middle + 1
            else:
                high = middle - 1
        return None

    def value(self, page: bytes, offset: int, size: int, flags: int, key_size: int, number: int) -> bytes:
        if not flags & F_BIGDATA:
            start = offset + NODE.size + key_size
            self.check_kind(flags, number)
            if start + size > self.page_size:
                raise self.damaged(f"page {number} has a value running past its end")
            return page[start:start + size]
        at = self.overflow(page, offset, size, flags, key_size, number)
        data = self.source.pread(size, at)
        if len(data) != size:
            raise self.damaged(f"the value at byte {at} is cut short")
        return data

    def check_kind(self, flags: int, number: int) -> None:
        if flags & (F_SUBDATA | F_DUPDATA):
            raise self.damaged(f"page {number} holds a sub-database or duplicate values, which packer never writes")

    def overflow(self, page: bytes, offset: int, size: int, flags: int, key_size: int, number: int) -> int:
        """The file offset of a value in overflow pages, its pages checked to hold it."""
        start = offset + NODE.size + key_size
        self.check_kind(flags, number)
        if start + 8 > self.page_size:
            raise self.damaged(f"page {number} has an overflow pointer running past its end")
        first = struct.unpack_from("<Q", page, start)[0]
        head = self.page(first)
        pages = OVERFLOW_PAGES.unpack_from(head, 12)[0]
        if not PAGE_HEADER.unpack_from(head)[2] & P_OVERFLOW or first + pages - 1 > self.last_page \
                or size > pages * self.page_size - HEADER_SIZE:
            raise self.damaged(f"the {size}-byte value at overflow page {first} does not fit its {pages} page(s)")
        return first * self.page_size + HEADER_SIZE

    def abort(self) -> None:
        """What an LMDB transaction's abort is: nothing to release here."""
