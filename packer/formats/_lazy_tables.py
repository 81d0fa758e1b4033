"""The per-record tables every Reader has, labels and paths, loaded lazily and once per process
and checked as they load (whole, or a block at a time where reads use them), with the errors of a
damaged table kept so that every later read reports them without reading it again."""
from __future__ import annotations

import numpy as np

from ..errors import CorruptDataError, PackError
from ._tables import DAMAGED, BlockChecks, check_count, check_labels, checked_whole


class LazyTables:
    """A SplitReader's labels and paths tables and the loading of any table (it sets path, split,
    count, classes, metadata, remote and _loaded, and open(); a format adds load_labels, load_paths and, where
    it maps the label table, map_labels)."""

    _label_blocks = None  # (mapped labels, BlockChecks) for label()
    _labels = None  # the labels property: the label table, checked whole
    _paths = None  # the paths property: the path table (PathTable), checked whole

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
        if checks.left:  # once every block has passed, no call
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
