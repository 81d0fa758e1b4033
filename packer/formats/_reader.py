"""The common ground of every format's Reader: split choice, count, CRC policy, record names."""
from __future__ import annotations

import os

from ..errors import CorruptDataError
from ..records import Metadata, checksum, choose_split
from ._handle import LazyHandle


class SplitReader(LazyHandle):
    """One split of a packed dataset. Subclasses add the layout: _open/_close and read(i)."""

    def __init__(self, path: str, split: str | None, check_crc: bool, metadata: Metadata):
        self.path = os.path.abspath(path)
        self.metadata = metadata
        self.split = choose_split(list(metadata.splits), split, self.path)
        self.classes = metadata.classes
        self.count = metadata.splits[self.split].count
        self.check_crc = check_crc

    def __len__(self) -> int:
        return self.count

    def where(self, index: int) -> str:
        return f"{self.path} record {self.split}/{index}"

    def check_index(self, index: int) -> None:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for split {self.split!r} of {self.count} records")

    def check_data(self, data: bytes, crc: int, where: str) -> None:
        """Raise if check_crc is on and data does not match the CRC stored with it."""
        if self.check_crc and checksum(data) != crc:
            raise CorruptDataError(f"{where}: checksum mismatch, the stored image is damaged "
                                   "(run packer verify; re-pack from the source)", self.path)
