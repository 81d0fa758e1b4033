"""Reads an unpacked ImageFolder tree through the same Reader interface as the formats."""
from __future__ import annotations

import os

import numpy as np

from .errors import BadImageError
from .records import PathTable, choose_split
from .scan import scan_source
from .source_io import read_regular_file


class FolderReader:
    """Random access to one split of a source folder: the raw-folder baseline.

    Holds no open files (each read opens one), so it is trivially fork- and spawn-safe.
    """

    def __init__(self, root: str, split: str | None = None, source=None):
        source = source if source is not None else scan_source(root)  # scanned already by the caller
        self.path = source.root
        self.classes = source.classes
        self.split = choose_split(list(source.splits), split, self.path)
        listing = source.splits[self.split]
        self.paths: PathTable = listing.paths
        self.labels: np.ndarray = listing.labels
        self.warnings = source.warnings

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> tuple[bytes, int, str]:
        data, label = self.read_image(index)
        return data, label, self.paths[index]

    def read_image(self, index: int) -> tuple[bytes, int]:
        relpath = self.paths[index]
        try:
            data = read_regular_file(os.path.join(self.path, relpath))
        except OSError as exc:
            raise BadImageError(relpath, f"cannot read file ({exc.strerror or exc})") from exc
        except BadImageError as exc:  # not a regular file (FIFO, device), or changed while read
            raise BadImageError(relpath, exc.reason) from None
        return data, int(self.labels[index])

    def open(self) -> "FolderReader":
        return self  # nothing held open: the listing is made when the reader is built

    def close(self) -> None:
        pass
