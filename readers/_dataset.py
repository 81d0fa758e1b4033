"""The map-style torch Dataset shared by every format: a packer Reader plus decode and transform
(ReaderDataset), and the one over a packed dataset of any format in packer.formats.FORMATS (PackedDataset)."""
from __future__ import annotations

from operator import index as plain_int  # int(i) for any index type, in one C call

import numpy as np
import torch.utils.data

from packer.errors import CorruptDataError, redact
from packer.formats import CAN_ADVISE, FORMATS, REMOTE_OPTIONS, detect_format

from .decode import DECODE_MODES, MAX_PIXELS, checked_max_pixels, decode
from .heap import keep_heap_in_worker
from .keyed import call_keyed, key_of
from .sampler import HINT_CHUNK, ReadAhead, reader_of


class ReaderDataset(torch.utils.data.Dataset):
    """ds[i] -> (image, label), like torchvision's ImageFolder.

    The wrapped Reader holds plain data until first access and opens its own handle in
    each process, so the dataset pickles (spawn, DDP) and survives fork.

    max_pixels: decoding refuses (CorruptDataError) an image whose header claims more
    pixels, before allocating them; the default is Pillow's own limit (readers.decode).

    An index that carries a sample key (readers.keyed.KeyedIndex, as packer's samplers
    hand them out) has the transform's random draws keyed to it; a plain int leaves them
    to torch's global generator.

    A DataLoader asks for a whole batch at once (__getitems__): over packed data every
    record of the batch is hinted to the kernel before the first is read, so a cold batch
    has all its reads in flight together, whatever sampler drew the indexes.
    """

    _read_ahead: ReadAhead | bool | None = None  # made on the first batch; False: the reader takes no hints

    def __init__(self, reader, transform=None, target_transform=None, decode: str = "pil",
                 max_pixels: int = MAX_PIXELS):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
        self.reader = reader
        self._checks_cuts = bool(getattr(reader, "may_be_cut", False))  # asked once: reads are hot
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        self.max_pixels = checked_max_pixels(max_pixels)
        self.classes: list[str] = list(reader.classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int):
        if self._checks_cuts:  # the file cut short since: an error, not SIGBUS (docs/safety.md)
            self.reader.check_not_cut()
        return self.read_item(index)

    def read_item(self, index: int):
        """self[index] without the check that the file was not cut short: __getitems__ checks
        once a batch (a batch of 64 made 65 fstat calls)."""
        # A plain int from here on: a KeyedIndex (an int subclass) slows each comparison and table lookup.
        position = plain_int(index)
        if position < 0:  # never a KeyedIndex: samplers hand out positions
            if position < -len(self):  # not wrapped round to a record at the end
                raise IndexError(f"index {index} out of range for split {self.split!r} of {len(self)} records")
            position += len(self)
        data, label = self.reader.read_image(position)
        try:
            image = decode(data, self.decode, max_pixels=self.max_pixels)
            if self.transform is not None:
                image = call_keyed(key_of(index), self.transform, image)
        except CorruptDataError as exc:
            if exc.path is not None:
                raise
            # Decoders and transforms are given bytes and cannot name the file; the name is
            # built here, on failure only, since reads are hot.
            where = f"{self.reader.path}: {self.paths[position]}"
            raise CorruptDataError(f"{where}: {exc.reason or exc}", where, exc.reason) from exc
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def __getitems__(self, indexes) -> list:
        """[self[i] for i in indexes], with the batch's reads started together.

        torch's DataLoader calls this with each batch's indexes (and collates the list it
        returns). One read at a time, a cold random batch waits for the disk once per
        record; here every record of the batch not already in the page cache is first
        handed to the kernel (Reader.will_need_records), HINT_CHUNK at a time, so the disk
        serves them together and each read then finds its bytes arriving or arrived.
        While chunks are found cached the hints back off (readers.sampler.ReadAhead): a
        warm dataset pays a probe now and then. A reader that takes no hints (the
        folder's, or without posix_fadvise) reads one record at a time, as ds[i] does.
        In a DataLoader worker, the first batch also has the worker keep its freed heap for
        the next batch (readers.heap). Keyed indexes give a KeyedSamples list, whose keys
        a collate of raw bytes hands on to the decoder (readers.collate.encoded_collate).
        """
        keep_heap_in_worker()
        if self._checks_cuts:  # before the hints below read the record tables; once for the batch
            self.reader.check_not_cut()
        indexes = list(indexes)
        hint = self.read_ahead()
        # Warm, the hints back off for whole batches: their records are not worked out at all.
        if hint is not None and not hint.skipped(-(-len(indexes) // HINT_CHUNK)):
            wanted = self.hintable(indexes)
            for k in range(0, len(wanted), HINT_CHUNK):
                hint(wanted[k:k + HINT_CHUNK])
        # A subclass's own __getitem__ still reads each item.
        read = self.read_item if type(self).__getitem__ is ReaderDataset.__getitem__ else self.__getitem__
        samples = [read(i) for i in indexes]
        keys = [key_of(i) for i in indexes]
        return KeyedSamples(samples, keys) if keys and keys[0] is not None else samples

    def read_ahead(self) -> ReadAhead | None:
        """This dataset's hinting state, or None when its reader takes no hints."""
        if self._read_ahead is None:
            reader = reader_of(self)
            takes_hints = reader is not None and CAN_ADVISE and hasattr(reader, "will_need_records")
            self._read_ahead = ReadAhead(reader) if takes_hints else False
        return self._read_ahead or None

    def hintable(self, indexes: list) -> np.ndarray:
        """The records indexes name, as int64 positions in range (negative ones counted from
        the end, as ds[i] takes them); bad ones are left to ds[i] to refuse, by name."""
        try:
            wanted = np.asarray(indexes, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError, OverflowError):
            return np.zeros(0, np.int64)
        n = len(self)
        wanted = np.where(wanted < 0, wanted + n, wanted)
        return wanted[(wanted >= 0) & (wanted < n)]

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
        """Every sample's path relative to the source folder, in order: a sequence that looks
        each one up through the pack's stored path offsets where it has them (packer's
        SplitReader.path_lookup: nothing per record in this process), else the path table."""
        lookup = getattr(self.reader, "path_lookup", None)
        return self.reader.paths if lookup is None else lookup()

    def close(self) -> None:
        self.reader.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({redact(self.reader.path)!r}, split={self.split!r}, "
                f"samples={len(self)}, classes={len(self.classes)}, decode={self.decode!r})")


class KeyedSamples(list):
    """A batch's samples, with `keys`, each sample's key: for a decoder that transforms
    them later, on the GPU (readers.nvjpeg) or in a collate (readers.hybrid)."""

    def __init__(self, samples: list, keys: list):
        super().__init__(samples)
        self.keys = keys


class PackedDataset(ReaderDataset):
    """Records of one split of a packed dataset, whatever its format, in ImageFolder order
    and labels, read through the format's Reader (packer.formats.FORMATS).

    The Reader opens its handle on first access in each process; one inherited through fork
    is closed and reopened, and pickling drops it. Set check_crc=False to skip the per-read
    record checksum check (of the pack's kind, xxh3 or crc32).

    path may be a URL (s3://..., https://..., gs://...; needs packer[remote]) for a format that
    reads one: storage_options (credentials, endpoint: fsspec's), cache_dir and cache_limit (a
    block cache shared by workers and ranks), block_size (docs/remote.md).

    A format's own subclass (LMDBDataset) sets `format`; here it is found at path unless given.
    """

    format: str | None = None

    def __init__(self, path, split=None, transform=None, target_transform=None, decode="pil", check_crc=True,
                 max_pixels=MAX_PIXELS, storage_options=None, cache_dir=None, cache_limit=None, block_size=None,
                 format=None):
        given = {"storage_options": storage_options, "cache_dir": cache_dir, "cache_limit": cache_limit,
                 "block_size": block_size}
        remote = {key: value for key, value in given.items() if value is not None}
        name = format or self.format or detect_format(path, **{key: remote[key] for key in REMOTE_OPTIONS
                                                                if key in remote})
        super().__init__(FORMATS[name].Reader(str(path), split, check_crc=check_crc, **remote),
                         transform, target_transform, decode, max_pixels)

