"""The map-style torch Dataset shared by every format: a packer Reader plus decode and transform."""
from __future__ import annotations

import numpy as np
import torch.utils.data

from packer.errors import CorruptDataError

from .decode import DECODE_MODES, MAX_PIXELS, checked_max_pixels, decode


class ReaderDataset(torch.utils.data.Dataset):
    """ds[i] -> (image, label), like torchvision's ImageFolder.

    The wrapped Reader holds plain data until first access and opens its own handle in
    each process, so the dataset pickles (spawn, DDP) and survives fork.

    max_pixels: decoding refuses (CorruptDataError) an image whose header claims more
    pixels, before allocating them; the default is Pillow's own limit (readers.decode).
    """

    def __init__(self, reader, transform=None, target_transform=None, decode: str = "pil",
                 max_pixels: int = MAX_PIXELS):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
        self.reader = reader
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        self.max_pixels = checked_max_pixels(max_pixels)
        self.classes: list[str] = list(reader.classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int):
        if index < 0:
            index += len(self)
        data, label = self.reader.read_image(index)
        try:
            image = decode(data, self.decode, max_pixels=self.max_pixels)
            if self.transform is not None:
                image = self.transform(image)
        except CorruptDataError as exc:
            if exc.path is not None:
                raise
            # Decoders and transforms are given bytes and cannot name the file; the name is
            # built here, on failure only, since reads are hot.
            where = f"{self.reader.path}: {self.reader.paths[index]}"
            raise CorruptDataError(f"{where}: {exc.reason or exc}", where, exc.reason) from exc
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def open(self) -> "ReaderDataset":
        """Open the reader in this process now rather than on the first item (see
        packer's SplitReader.open). Returns self."""
        self.reader.open()
        return self

    @property
    def split(self) -> str:
        return self.reader.split

    @property
    def targets(self) -> np.ndarray:
        """Every sample's label, in order (int32), without reading any image."""
        return self.reader.labels

    @property
    def paths(self):
        """Every sample's path relative to the source folder, in order."""
        return self.reader.paths

    def close(self) -> None:
        self.reader.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.reader.path!r}, split={self.split!r}, "
                f"samples={len(self)}, classes={len(self.classes)}, decode={self.decode!r})")
