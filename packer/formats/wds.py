"""WebDataset: per split a folder of standard tar shards plus a JSON index; writer and reader.

  OUT.wds/index.json                 packer.records.Metadata, plus "wds": the shard index; each
                                     split's entry holds "records_crc32" and "paths_crc32", the
                                     CRC-32 (zlib) of its two tables below (missing in packs
                                     written before table checksums: tables only range-checked)
  OUT.wds/<split>/shard-000000.tar   standard tar, readable by webdataset and by `tar`
  OUT.wds/<split>/records.bin        28 bytes per sample, little-endian, in ImageFolder order:
                                     uint32 shard, uint32 record checksum (of the kind the
                                     metadata's "checksum" names, packer.checksum: CRC-32
                                     where absent), uint64 data offset,
                                     uint64 data size, int32 label
  OUT.wds/<split>/paths.bin          relative paths in ImageFolder order, UTF-8 joined by NUL
  OUT.wds/<split>/path_offsets.bin   uint64 per sample + 1, little-endian: path i is paths.bin's
                                     bytes [offsets[i], offsets[i + 1] - 1) (offsets[0] = 0, the
                                     last = the size of paths.bin + 1; an empty split: the one
                                     entry 0) ("path_offsets" and "path_offsets_crc32" in the
                                     split's entry; absent in packs written before it, whose
                                     readers find the offsets by scanning paths.bin for NULs)
  OUT.wds/<split>/order.bin          int32 per sample, little-endian: the index of the sample at
                                     each position of the split's shards, shard by shard ("order"
                                     and "order_crc32" in the split's entry; absent when the pack
                                     is not shuffled, whose shards hold runs of indexes in order,
                                     and in packs written before it, whose readers sort records.bin
                                     by shard and offset instead)
  OUT.wds/<split>/positions.bin      int32 per sample, little-endian: sample i's position in the
                                     shards (positions[order[j]] = j) ("positions", "positions_crc32";
                                     beside order.bin, absent in packs written before it)
  OUT.wds/<split>/wids-index.json    (layout 2) the split's shards as webdataset's indexed
                                     reader loads them, wids.ShardListDataset(<this file>):
                                     {"wids_version": 1, "name": "<split>", "classes": [...],
                                     "shardlist": [{"url": "shard-000000.tar", "nsamples": N},
                                     ...]}, urls relative to this file, in shard order
                                     (wids 0.1 takes member names from the ustar field
                                     alone, so it misreads a split with names that are not
                                     ASCII or over 100 bytes: pack warns of those)

The index names only files of its own dataset: load_index refuses any name but
<split>/<name>.tar, <split>/records.bin, <split>/paths.bin, <split>/wids-index.json
(the split's "wids_index", absent before layout 2), <split>/order.bin (its "order") and
<split>/path_offsets.bin (its "path_offsets"), <split>/positions.bin (its "positions") and
any that resolves (through a symlink) outside OUT.wds (_wds_index). Its metadata checksum ("crc32", see packer.records) leaves out
"wds": each shard has its SHA-256 and size there, which verify checks; verify also checks
that each wids index lists exactly the split's shards, sample counts and classes.

A sample is three consecutive members, two in an unlabeled split (see _tar for the header rules):
  <key>.<ext>    the original file bytes; ext names the content, as webdataset's decoders
                 and recipes expect (packer.check.sniff: JPEG -> jpg, PNG -> png, WebP ->
                 webp, BMP -> bmp, TIFF -> tiff, PNM -> the file's own ppm/pgm), and for
                 content sniff does not know (--check none) the file's extension, lowercased;
                 layout 1 always used the lowercased extension (ImageNet's .JPEG -> jpeg)
  <key>.cls      the label as ASCII decimal (no member for unlabeled splits)
  <key>.json     {"<kind>": <int>, "label": <int>, "path": "<relative path>"}, keys sorted, no
                 spaces, UTF-8 with no character escaped (label -1 = unlabeled; packs written
                 before it have no "label");
                 <kind> is the record checksum kind ("crc32" or "xxh3", packer.checksum) and
                 its value the record's checksum, so a tool that checks "crc32" never
                 mistakes another kind for it

webdataset keys end at the first dot of the last path component, so a key keeps the
relative path's folders and turns the file name into <stem>_<ext> (ext as the file
spells it: `x.JPEG` gives key `x_JPEG`, its image member `x_JPEG.jpg`) with "%" and "." in
the stem (and also "_" in the ext) percent-escaped: `v1.2/img.v2.final.jpg` becomes key
`v1.2/img%2Ev2%2Efinal_jpg`. The ext part has no "_", so the last "_" splits it off and
the key is unique even for `x.jpg` beside `x.png`, with no state kept while writing.

A shard is started before one would exceed shard_size bytes or hold max_count samples.
shard_size None (the default) is "auto", a balanced split (packer.formats._shards): about
AUTO_SHARDS shards of the same number of samples to within one, so ranks that take
whole shards get equal shares and pad little.

Shards are written in the order pack() hands samples over (a seeded permutation of
ImageFolder order unless --no-shuffle), so sequential readers see mixed classes. The
records and paths tables stay in ImageFolder order, so the map-style Reader, verify
and convert see the same order as every other format; read(i) is one pread.

The Reader maps records.bin and paths.bin rather than reading them into each process
(_tables: their pages are the page cache's, shared by every process that reads the
dataset). Opening checks records.bin's length against the metadata's count; a read checks
the block of records around its own on first use (each record's shard among the split's
shards, its bytes within that shard's file, its label against the class list), and
check_tables (verify) each table whole with its CRC-32 (docs/safety.md). A Reader is tied to the index.json it read
(inode, size, mtime: _tables.file_identity): each table and shard it opens later,
in any process, is checked to belong to it, so a dataset replaced at its path while in
use (pack --force) is refused rather than mixed with the old one.

A folder named by URL (`s3://bucket/imagenet.wds`) is read the same way through
packer.remote: index.json and the split's two tables are read whole, a record is a
ranged read of its shard, and each shard is checked to be the size the index says
when first opened.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..checksum import LEGACY, MASK
from ..errors import CorruptDataError, FormatError, PackError
from ..records import PATH_ENCODING_ERRORS, Metadata, PathTable, check_split_name
from ..remote import source as remote_source
from . import _io, _tar
from ._tar import member_suffix, sample_key, source_suffix  # noqa: F401 (the key rules: the docstring above)
from ._contract import Format, Option, parse_size, positive_int
from ._index_tables import OFFSET, POSITION, inverse_chunks, offsets_of, path_offset_chunks, stored_positions
from ._files import ShardDigest, shards_problems, write_synced, write_synced_chunks
from ._reader import SplitReader
from ._shards import (AUTO_SHARDS, MAX_AUTO_SHARD_SIZE, MIN_AUTO_SHARD_SIZE, PLAN_SAMPLES,  # noqa: F401
                      BalancedCut, auto_shard_size, balanced_shard_count, few_shards_warning)
from ._tables import (DAMAGED, BlockChecks, SpillTable, array_chunks, blocks, check_count, check_labels, check_within,
                      checked_whole, dataset_identity, nul_separated_chunks)
from ._wds_index import INDEX, LAYOUT_VERSION, foreign, foreign_index, info_facts, load_index, open_index, read_remote
from ._wids import WIDS_INDEX, long_names_warning, wids_index_bytes, wids_index_problems

EXTENSION = ".wds"
DIRECTORY = True
DEFAULT_SHARD_SIZE = None  # auto, see the module docstring
SHARD_NAME = "shard-{:06d}.tar"
PATH_OFFSETS = "path_offsets.bin"
POSITIONS = "positions.bin"
RUN_CHECK = 4096  # records of a shard's run checked at a time (check_run)
RECORD = np.dtype([("shard", "<u4"), ("crc", "<u4"), ("offset", "<u8"), ("size", "<u8"), ("label", "<i4")])


def detect(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX)) and not foreign_index(path)


def read_metadata(path: str) -> Metadata:
    return open_index(path)[1]


class Writer:
    """Streams samples into shards of at most shard_size bytes (None: auto) and max_count samples."""

    def __init__(self, stage: str, options: dict):
        self.stage = stage
        self.shard_size = options["shard_size"]
        self.max_count = options["max_count"]
        self.splits: dict[str, dict] = {}
        self.file = None
        self.warnings: list[str] = []
        self.kind = options.get("checksum", LEGACY)  # names each sample's checksum in its .json
        self.hasher: ThreadPoolExecutor | None = None  # ShardDigest's thread, made with the first shard

    def begin_split(self, split: str, expected_count: int | None = None) -> None:
        """expected_count: the samples pack() will add at most, for the auto shard size."""
        check_split_name(split)
        self.split = split
        self.expected_count = expected_count
        # Cut by sample count (a balanced split) when no size is set and the count is known.
        balanced = self.shard_size is None and self.max_count is None and bool(expected_count)
        self.cut = BalancedCut(expected_count) if balanced else None
        self.split_bytes = 0
        os.makedirs(os.path.join(self.stage, split))
        self.shards: list[dict] = []
        # The split's records in write order, spilled to an unlinked file as they come, not held.
        self.rows = SpillTable(RECORD, self.stage)
        self.long_names, self.long_name = 0, None  # samples named by PAX records (note_long_names)

    def add(self, data: bytes, label: int, relpath: str, crc: int) -> None:
        key = sample_key(relpath)
        name, meta_name = f"{key}.{member_suffix(data, relpath)}", f"{key}.json"
        if not (_tar.fits_ustar(name) and _tar.fits_ustar(meta_name)):
            self.long_names += 1
            self.long_name = self.long_name or relpath
        image, data_at = _tar.member(name, data)
        parts = [image]
        if label >= 0:
            parts.append(_tar.member(f"{key}.cls", str(label).encode())[0])
        meta = json.dumps({self.kind: crc, "label": label, "path": relpath}, ensure_ascii=False, sort_keys=True,
                          separators=(",", ":"))
        parts.append(_tar.member(meta_name, meta.encode("utf-8", PATH_ENCODING_ERRORS))[0])
        blob = b"".join(parts)
        full = self.file is not None and self.count > 0 and (
            (self.max_count is not None and self.count >= self.max_count)
            or self.bytes + len(blob) + len(_tar.END_OF_ARCHIVE) > self.split_shard_size(len(blob))
            or (self.cut is not None and self.cut.full(len(self.shards), len(self.rows), self.count,
                                                       self.split_bytes + len(blob))))
        if self.cut is not None:
            self.cut.note(len(self.rows), self.split_bytes + len(blob), full)
        if self.file is None or full:
            self.next_shard()
        self.split_bytes += len(blob)
        self.rows.append((len(self.shards), crc, self.bytes + data_at, len(data), label))
        self.file.write(blob)
        self.digest.update(blob)
        self.bytes += len(blob)
        self.count += 1

    def split_shard_size(self, next_blob: int) -> int:
        """The byte bound in force: the option's, a balanced split's ceiling, or auto from the
        mean sample so far (next one included) beside a max_count."""
        if self.shard_size is not None:
            return self.shard_size
        if not self.expected_count or self.cut is not None:
            return MAX_AUTO_SHARD_SIZE
        added = len(self.rows) + 1
        return auto_shard_size((self.split_bytes + next_blob) / added, self.expected_count)

    def next_shard(self) -> None:
        self.close_shard()
        self.name = f"{self.split}/{SHARD_NAME.format(len(self.shards))}"
        self.file = open(os.path.join(self.stage, self.name), "wb")
        if self.hasher is None:
            self.hasher = ThreadPoolExecutor(1, thread_name_prefix="shard-sha256")
        self.digest, self.bytes, self.count = ShardDigest(self.hasher), 0, 0

    def close_shard(self) -> None:
        if self.file is None:
            return
        self.file.write(_tar.END_OF_ARCHIVE)
        self.digest.update(_tar.END_OF_ARCHIVE)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        self.shards.append({"name": self.name, "count": self.count, "bytes": self.bytes + len(_tar.END_OF_ARCHIVE),
                            "sha256": self.digest.hexdigest()})

    def end_split(self, labels: np.ndarray, paths: PathTable, order: np.ndarray | None = None) -> None:
        """Write the split's tables; order[j] is the ImageFolder rank of the j-th added sample."""
        self.close_shard()
        count = len(self.rows)
        if count != len(labels):
            raise ValueError(f"split {self.split}: {count} samples added but {len(labels)} labels given")
        folder = os.path.join(self.stage, self.split)
        # Written a chunk at a time from the spilled rows, rearranged into ImageFolder order:
        # neither table is ever whole in memory. Synced, as the shards are: on disk before the
        # dataset is published.
        chunks = self.rows.chunks() if order is None else self.rows.chunks_in(order)
        records_crc = write_synced_chunks(os.path.join(folder, "records.bin"),
                                          (rows.view(np.uint8) for rows in chunks))
        self.rows.close()
        paths_crc = write_synced_chunks(os.path.join(folder, "paths.bin"), nul_separated_chunks(paths))
        offsets_crc = write_synced_chunks(os.path.join(folder, PATH_OFFSETS),
                                          (chunk.view(np.uint8) for chunk in path_offset_chunks(paths)))
        entry = self.splits[self.split] = {"count": count, "shards": self.shards,
                                           "records": f"{self.split}/records.bin", "paths": f"{self.split}/paths.bin",
                                           "path_offsets": f"{self.split}/{PATH_OFFSETS}",
                                           "wids_index": f"{self.split}/{WIDS_INDEX}",
                                           "records_crc32": records_crc, "paths_crc32": paths_crc,
                                           "path_offsets_crc32": offsets_crc}
        if order is not None:  # the storage order: a reader streams a shard without sorting records.bin
            entry.update(order=f"{self.split}/order.bin", order_crc32=write_synced_chunks(
                os.path.join(folder, "order.bin"), (np.ascontiguousarray(c, "<i4").view(np.uint8)
                                                    for c in array_chunks(order))))
            # Its inverse, a window at a time: proves order.bin a permutation with no byte a sample.
            entry.update(positions=f"{self.split}/{POSITIONS}", positions_crc32=write_synced_chunks(
                os.path.join(folder, POSITIONS), (c.view(np.uint8) for c in inverse_chunks(order))))
        self.warnings += [warning for warning in (few_shards_warning(self.split, len(self.shards), count),
                                                  long_names_warning(self.split, self.long_names, self.long_name))
                          if warning]

    def finish(self, meta: Metadata) -> None:
        self.stop_hasher()
        for split, entry in self.splits.items():
            write_synced(os.path.join(self.stage, entry["wids_index"]), wids_index_bytes(split, entry, meta.classes))
        index = {**meta.to_dict(), "wds": {"layout_version": LAYOUT_VERSION, "shard_size": self.shard_size,
                                          "max_count": self.max_count, "splits": self.splits}}
        # Non-UTF-8 file names (possible on Linux) survive as surrogate escapes, as in every format.
        write_synced(os.path.join(self.stage, INDEX),
                     json.dumps(index, ensure_ascii=False, indent=1).encode("utf-8", PATH_ENCODING_ERRORS))

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.stop_hasher()

    def stop_hasher(self) -> None:
        if self.hasher is not None:
            self.hasher.shutdown(wait=True, cancel_futures=True)  # at most PENDING blobs
            self.hasher = None


class Reader(SplitReader):
    """Random access to one split's samples in ImageFolder order: one pread per sample.

    The handle is a dict of open shard descriptors, opened as samples need them.

    path may be a URL; storage_options, cache_dir, cache_limit and block_size then say
    how to read it (packer.remote.source.Remote).
    """

    # records.bin whole and checked whole (records); mapped with its BlockChecks (record_blocks);
    # stored_in's bounds in the order, which shards' runs of it it checked, and whether it sorts
    # records.bin (a pack shuffled before order.bin); the shard descriptor indexed() last passed.
    TABLES = {"_records": None, "_record_blocks": None, "_shard_starts": None, "_runs_checked": None,
              "_runs_sorted": False, "_sized": None}
    reads_by_position = False  # records.bin is in index order: read_image looks up the index

    def __init__(self, path: str, split: str | None = None, check_crc: bool = True, **remote):
        remote = remote_source.remote_for(path, **remote)
        if remote is None and not detect(path):
            raise FormatError(f"{path}: not a packer WebDataset folder (no {INDEX} inside)", path)
        index, metadata = open_index(path if remote else os.path.abspath(path), remote)
        super().__init__(path, split, check_crc, metadata)
        if remote is not None:
            self.read_remotely(remote)
        entry = index["wds"]["splits"][self.split]
        self.shards, self.shard_bytes, self.shard_counts = ([shard[key] for shard in entry["shards"]]
                                                            for key in ("name", "bytes", "count"))
        self.tables = (entry["records"], entry["paths"])
        self.order_table = entry.get("order")  # None: sort records.bin (read_order)
        self.offsets_table = entry.get("path_offsets")  # None: scan paths.bin for its offsets
        self.positions_table = entry.get("positions")  # None: check order.bin with a byte a sample
        self.__dict__.update(self.TABLES)
        self.bind(entry)

    def bind(self, entry: dict) -> None:
        """Tie this reader to the index.json it read, and note the table checksums its split's entry holds."""
        self.identity_file = os.path.join(self.path, INDEX)
        self.identity = (dataset_identity(self.identity_file) if self.remote is None
                         else self.remote.identity(self.identity_file))
        crcs = {name: entry.get(f"{name}_crc32") for name in ("records", "paths", "order", "path_offsets", "positions")
                if entry.get(name) is not None}
        self._table_crcs = None if all(crc is None for crc in crcs.values()) else crcs

    def table_checksums(self) -> dict | None:
        crcs = self._table_crcs
        if crcs is not None and not all(type(crc) is int and 0 <= crc <= 0xFFFFFFFF for crc in crcs.values()):
            raise CorruptDataError(f"{self.identity_file}: split {self.split}: the table checksums are "
                                   f"unreadable; {DAMAGED}", self.path)
        return crcs

    def read_table(self, name: str, size: int | None = None, crc: bool = True) -> tuple:
        """Table name (records or paths) as (map, start, length), checked (SplitReader.table_file)."""
        return self.table_file(name, self.tables[0 if name == "records" else 1], size, RECORD.itemsize, crc)

    def load_records(self) -> np.ndarray:
        """records.bin, checked whole: its CRC-32, every record as record_check checks a
        block, and the records' sizes adding up to the split's bytes."""
        region, start, size = self.read_table("records", self.count * RECORD.itemsize)
        records = np.frombuffer(region, RECORD, size // RECORD.itemsize, start)
        check, where = record_check(self, records), os.path.join(self.path, self.tables[0])
        for begin, end in blocks(len(records)):
            check(begin, end)
        total = int(records["size"].sum(dtype=np.uint64))
        if total != self.metadata.splits[self.split].bytes:
            raise CorruptDataError(f"{where}: the records' sizes add up to {total} bytes, the metadata says "
                                   f"{self.metadata.splits[self.split].bytes}; {DAMAGED}", self.path)
        return records

    def record_blocks(self) -> tuple:
        """(records.bin, mapped, and its BlockChecks): read_image checks the block of records
        around its own on first use (record_check); the table's CRC-32 and the sum of its
        sizes are left to check_tables (load_records)."""
        if self._record_blocks is None:
            self._record_blocks = self.loaded("record blocks", self.map_records)
        return self._record_blocks

    def map_records(self) -> tuple:
        if self.remote is not None:  # read whole at a URL in any case: once, checked whole
            return self.records, BlockChecks(self.count, checked_whole)
        region, start, size = self.read_table("records", self.count * RECORD.itemsize, crc=False)
        records = np.frombuffer(region, RECORD, size // RECORD.itemsize, start)
        return records, BlockChecks(self.count, record_check(self, records))

    def check_layout_tables(self) -> None:
        self.records  # loaded whole: its CRC-32 and every check
        if self.offsets_table is not None:
            self.table_file("path_offsets", self.offsets_table, (self.count + 1) * OFFSET.itemsize, OFFSET.itemsize)
        self.check_path_index()
        if self.order_table is not None:
            region, start, _ = self.table_file("order", self.order_table, self.count * 4, 4)
            self.checked_order(np.frombuffer(region, "<i4", self.count, start))
        check_positions(self)

    def map_labels(self) -> tuple[np.ndarray, str]:
        return self.record_blocks()[0]["label"], os.path.join(self.path, self.tables[0])

    def shard_size(self, shard: int) -> int:
        """The size of a shard's file; for a missing one, no bound (reading it says it is missing).
        Remote: the size the index gives (each shard is checked to have it when opened)."""
        if self.remote is not None:
            return self.shard_bytes[shard]
        try:
            return os.stat(os.path.join(self.path, self.shards[shard])).st_size
        except OSError:
            return np.iinfo(np.uint64).max

    def load_labels(self) -> np.ndarray:
        return np.asarray(self.records["label"], np.int32)  # a view of the mapped table, checked whole

    def stored_path_offsets(self) -> tuple | None:
        if self.offsets_table is None:
            return None
        where = os.path.join(self.path, self.offsets_table)
        return offsets_of(self.table_file("path_offsets", self.offsets_table, (self.count + 1) * OFFSET.itemsize,
                                          OFFSET.itemsize, crc=False), where, self.path), where

    def stored_positions(self) -> tuple | None:
        return mapped_positions(self)

    def mapped_paths(self) -> tuple:
        return self.read_table("paths", crc=False)

    def load_paths(self) -> PathTable:
        where = os.path.join(self.path, self.tables[1])
        region, start, size = self.read_table("paths")
        paths = PathTable.from_nul_separated(region, where, start, size)
        check_count(len(paths), self.count, where, "paths")
        return paths

    @property
    def records(self) -> np.ndarray:
        if self._records is None:
            self._records = self.loaded("records", self.load_records)
        return self._records

    def _open(self) -> dict:
        self.check_identity()  # a worker opening afresh fails here, before any read
        return {}

    def _close(self, fds: dict) -> None:
        for fd in fds.values():
            _io.close(fd)

    def shard_fd(self, shard: int) -> int:
        fds = self.handle()
        if shard not in fds:
            fds[shard] = self.open_member(self.shards[shard], self.shard_bytes[shard])
        return fds[shard]

    def load_tables(self) -> None:
        self.record_blocks()

    def read_order(self) -> np.ndarray:
        """The sample at each position of the shards, shard by shard (int32, as stored orders
        are): order.bin, mapped, where the pack has one (stored_in checks each shard's run on
        first use, check_tables the whole table); else sorted out of records.bin."""
        if self.order_table is None:
            return np.lexsort((self.records["offset"], self.records["shard"])).astype(np.int32)
        region, start, _ = self.table_file("order", self.order_table, self.count * 4, 4, crc=False)
        return np.frombuffer(region, "<i4", self.count, start)

    def stored_in(self, shard: int) -> np.ndarray:
        """The indexes of the samples shard holds, in the order it holds them, checked on first
        use to be the shard's own samples in the order of their offsets: a view of
        storage_order() between the index's sample counts or, in a pack without order.bin whose
        shard holds a run of indexes (one written unshuffled), that run, so that streaming a
        shard sorts nothing and holds nothing sized by the split."""
        if self._shard_starts is None:
            self._shard_starts = np.concatenate([[0], np.cumsum(self.shard_counts, dtype=np.int64)])
            self._runs_checked = bytearray(len(self.shards))
        begin, end = self._shard_starts[shard], self._shard_starts[shard + 1]
        if self.order_table is None and not self._runs_sorted:
            run = np.arange(begin, end, dtype=np.int32)  # an unshuffled pack stores index order
            if self._runs_checked[shard] or run_fits(self, shard, run):
                self._runs_checked[shard] = 1
                return run
            self._runs_sorted = True  # shuffled before order.bin: sort records.bin (read_order)
        run = self.storage_order()[begin:end]
        if not self._runs_checked[shard]:
            self.check_run(shard, run)
            self._runs_checked[shard] = 1
        return run

    def check_run(self, shard: int, run: np.ndarray) -> None:
        """Raise unless run, the order's stretch for shard, holds shard's samples by offset,
        each within the shard's file, its label in range (as record_check checks a block),
        RUN_CHECK records at a time: a shard's records are never copied whole."""
        records, where = self.record_blocks()[0], os.path.join(self.path, self.order_table or self.tables[0])
        fits, last = not len(run) or (0 <= run.min() and run.max() < self.count), -1
        for begin in range(0, len(run) if fits else 0, RUN_CHECK):
            mine = records[run[begin:begin + RUN_CHECK]]
            offsets = mine["offset"]
            if (mine["shard"] != shard).any() or int(offsets[0]) <= last or (offsets[1:] <= offsets[:-1]).any():
                fits = False
                break
            last = int(offsets[-1])
            check_within(offsets, mine["size"], self.shard_size(shard), where, "record")
            check_labels(mine["label"], len(self.classes), self.metadata.splits[self.split].labeled, where)
        if not fits:
            raise CorruptDataError(f"{where}: shard {shard}'s {len(run)} samples are not the ones records.bin puts "
                                   f"in it, in order; {DAMAGED}", self.path)

    def as_indexed(self, shard: int) -> bool:
        """indexed(): whether wds_shards.read_stored can read shard by the index."""
        return indexed(self, shard)

    def close_other_shards(self, shard: int) -> None:
        """Close every shard's descriptor but shard's: a stream reads its shards one after another."""
        for other in [k for k in self._handle if k != shard] if self.is_open else ():
            _io.close(self._handle.pop(other))
            self._sized = None if self._sized is not None and self._sized[1] == other else self._sized

    def will_need(self, start: int, stop: int) -> None:
        records, checks = self.record_blocks()
        indexes = self.storage_order()[start:stop]
        checks.ensure_all(indexes)
        chosen = records[indexes]
        for shard in np.unique(chosen["shard"]).tolist():
            mine = chosen[chosen["shard"] == shard]
            first = int(mine["offset"].min())
            _io.will_need_uncached(self.shard_fd(shard), first, int((mine["offset"] + mine["size"]).max()) - first)

    def record_extents(self, indexes: np.ndarray):
        if not len(indexes):
            return ()
        records, checks = self.record_blocks()
        checks.ensure_all(indexes)
        chosen = records[indexes]
        return ((self.shard_fd(shard), offset, size)
                for shard, offset, size in zip(chosen["shard"].tolist(), chosen["offset"].tolist(),
                                               chosen["size"].tolist()))

    def read_record(self, index: int) -> tuple[bytes, int]:
        self.check_index(index)
        records, checks = self._record_blocks or self.record_blocks()
        if checks.left:  # once every block has passed, no call
            checks.ensure(index)
        shard, crc, offset, size, label = records[index].tolist()
        data = _io.pread(self.shard_fd(shard), size, offset)
        if len(data) != size:
            raise CorruptDataError(f"{self.where(index)} ({self.path_of(index)}): shard truncated, {size} bytes "
                                   f"expected at byte {offset} (re-pack, or restore the shard from a copy)", self.path)
        if self.check_crc and self.record_digest(data) & MASK != crc:  # check_data, inlined: a call less per read
            self.checksum_mismatch(index)
        return data, label

    def where(self, index: int) -> str:
        shard = self.record_blocks()[0]["shard"].item(index)  # checked: where() names a record read
        return f"{self.path}/{self.shards[shard]} sample {self.split}/{index}"


def record_check(reader: Reader, records: np.ndarray):
    """check(begin, end): raise unless reader's records [begin, end) each name one of the split's
    shards, lie within that shard's file and hold a label in range."""
    where, shards = os.path.join(reader.path, reader.tables[0]), len(reader.shards)
    sizes = np.array([reader.shard_size(k) for k in range(shards)], np.uint64)  # one stat a shard
    classes, labeled, path = len(reader.classes), reader.metadata.splits[reader.split].labeled, reader.path

    def check(begin: int, end: int) -> None:  # not a method: the reader holds it, so no cycle
        part = records[begin:end]
        if int(part["shard"].max()) >= shards:
            raise CorruptDataError(f"{where}: a record names shard {int(part['shard'].max())}, the split has "
                                   f"{shards}; {DAMAGED}", path)
        check_within(part["offset"], part["size"], sizes, where, "record", size_of=part["shard"])
        check_labels(part["label"], classes, labeled, where)
    return check


def mapped_positions(reader: Reader) -> tuple | None:
    """reader.stored_positions(): positions.bin, mapped, and its BlockChecks against order.bin; None
    where the pack has none, or at a URL (order.bin is checked with a byte a sample, not fetched twice)."""
    if reader.positions_table is None or reader.remote is not None:
        return None
    region, start, _ = reader.table_file("positions", reader.positions_table, reader.count * POSITION.itemsize,
                                         POSITION.itemsize, crc=False)
    order = None if reader.order_table is None else reader.read_order()  # else records.bin sorted, not stored
    return stored_positions(np.frombuffer(region, POSITION, reader.count, start), order,
                            os.path.join(reader.path, reader.positions_table), reader.path)


def check_positions(reader: Reader) -> None:
    """check_tables' check of positions.bin once order.bin passed: its CRC-32, every block the inverse."""
    if reader.positions_table is not None:
        reader.table_file("positions", reader.positions_table, reader.count * POSITION.itemsize, POSITION.itemsize)
    if reader.position_table() is not False and reader._position_checks is not None:
        reader._position_checks.ensure_every()


def indexed(reader: Reader, shard: int) -> bool:
    """Whether shard's file opens and is the size the index gives, and its samples' records
    pass stored_in's checks: what wds_shards.read_stored needs. Asked once for each
    descriptor opened (reader._sized holds the last that passed, until it is closed): a
    stream's runs of one shard (a resumed pass's one-sample runs) read through the
    descriptor checked for the first (a file cut short since fails its reads there)."""
    try:
        fds, fd = reader.handle(), reader.shard_fd(shard)
        if reader._sized is not None and reader._sized[0] is fds and reader._sized[1:] == (shard, fd):
            return True
        fits = os.fstat(fd).st_size == reader.shard_bytes[shard]
        fits = fits and stored_part(reader, shard, 0, 0) is not None  # stored_in raises for damaged records
    except (CorruptDataError, OSError):
        return False
    reader._sized = (fds, shard, fd) if fits else None
    return fits


def stored_part(reader: Reader, shard: int, start: int, stop: int | None) -> np.ndarray:
    """reader.stored_in(shard)[start:stop], made for that part alone where the shard's run is a
    checked run of indexes (an unshuffled pack's): a resumed stream reads many one-sample
    parts of a shard, each of which would otherwise make the shard's whole run."""
    if reader.order_table is None and not reader._runs_sorted and reader._runs_checked is not None \
            and reader._runs_checked[shard]:
        part = range(int(reader._shard_starts[shard]), int(reader._shard_starts[shard + 1]))[start:stop]
        return np.arange(part.start, part.stop, dtype=np.int32)
    return reader.stored_in(shard)[start:stop]


def run_fits(reader: Reader, shard: int, run: np.ndarray) -> bool:
    """Whether run passes reader.check_run as shard's samples."""
    try:
        reader.check_run(shard, run)
    except CorruptDataError:
        return False
    return True


def check_files(path: str) -> list[str]:
    """Shard-level problems verify adds to the per-sample ones: size, SHA-256, tar structure.

    Shards are hashed by threads (hashlib releases the GIL). A shard whose size and SHA-256
    match the index holds the bytes the writer wrote; its sample count is then checked
    against records.bin (which records each sample's shard, CRC-checked as it loads)
    rather than by parsing its millions of tar headers in Python again. A damaged shard,
    or one of a split whose records.bin does not load, is parsed, to say what is wrong."""
    index = load_index(path)
    problems, checks = [], []
    for split, entry in index["wds"]["splits"].items():
        if "wids_index" in entry:
            problems += wids_index_problems(path, split, entry, index["classes"], INDEX)
        counts = table_shard_counts(path, split, len(entry["shards"]))
        checks += [(shard, None if counts is None else int(counts[k])) for k, shard in enumerate(entry["shards"])]
    return problems + shards_problems(path, checks, _tar.count_samples)


def table_shard_counts(path: str, split: str, shards: int) -> np.ndarray | None:
    """How many of the split's samples records.bin puts in each shard, or None when it does not load."""
    try:
        reader = Reader(path, split)
        records = reader.records
    except PackError:
        return None
    counts = np.zeros(shards, np.int64)
    for block in array_chunks(records["shard"]):
        counts += np.bincount(block, minlength=shards)[:shards]
    reader.close()
    return counts


FORMAT = Format(
    name="wds", aliases=("webdataset", "tar"), extension=EXTENSION, directory=DIRECTORY, Writer=Writer, Reader=Reader, detect=detect,
    read_metadata=read_metadata, check_files=check_files, info_facts=info_facts, title="WDS",
    held_as=f"an {INDEX}", entry=INDEX, read_remote=read_remote, foreign=foreign,
    # Shards in ImageFolder order hold one class each: streaming readers need them mixed.
    shuffled_by_default=True,
    options=(
        Option("shard_size", parse_size, DEFAULT_SHARD_SIZE,
               "start a new shard before one would exceed this: 1GB, 256MB, 512KB (powers of 1000), 1GiB, "
               "or a byte count [default: auto, about 64 shards per split of 4MB to 1GB each, with equal sample "
               "counts so that ranks get equal shares]"),
        Option("max_count", positive_int, None, "at most this many samples per shard"),
    ))

