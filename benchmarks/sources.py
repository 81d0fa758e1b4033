"""The rows of the table: each way of reading the same corpus, as a small case in SOURCES.

A source names the files it reads (so the page cache can be made cold or warm), yields
samples for the single-process measures (random order for map-style datasets, shard
order for shards), and builds the loader for the end-to-end measure. A source whose
format or API is missing reports why through missing() and its row reads "n/a".
"""
from __future__ import annotations

import itertools
import os
import random
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.utils.data

import readers
from packer.check import IMAGE_EXTENSIONS, IMAGE_SUFFIXES
from packer.formats import FORMATS

from . import cache
from .augment import augment_pil, train_transform

PEER_LOADER = "peer: torch DataLoader + synchronous .to(device) + normalise"
PILLOW_AUGMENT = "Pillow RandomResizedCrop(224) + flip (torchvision's path) -> uint8 tensor"


def _order(n: int, seed) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def _epochs(epochs: int | None) -> Iterable[int]:
    """0, 1, ... epochs - 1; without end for None (the consumer stops when its time is up)."""
    return itertools.count() if epochs is None else range(epochs)


def _uint8_chw(image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)  # a writable copy, as torch wants


def read_setup(mode: str) -> tuple[str, object]:
    """(decode mode, transform) of a single-process measure: raw, decode or augment."""
    if mode == "augment":
        transform, decode, _ = train_transform()
        return decode, transform
    return {"raw": "raw", "checked": "raw", "decode": "numpy"}[mode], None


class Loader:
    """What a source hands the end-to-end measure: batches, and whether they are on the device yet."""

    def __init__(self, batches, how: str, on_device: bool, dataset=None):
        self.batches, self.how, self.on_device, self.dataset = batches, how, on_device, dataset

    def close(self) -> None:
        close = getattr(self.dataset, "close", None)
        if close is not None:
            close()


def packer_loader(dataset, opts, how_augment: str) -> Loader:
    """readers.make_loader (a CUDAPrefetcher on CUDA) over dataset, as packer users feed a GPU."""
    # Fresh workers for every timed run: a persistent worker would keep LMDB's map, and so its
    # pages, alive across the eviction that makes the next run cold.
    # The run's seed fixes the shuffle: every map-style source of a round reads the same records in the same order.
    batches = readers.make_loader(dataset, opts.batch_size, device=opts.device, train=True, workers=opts.workers,
                                  persistent_workers=False, seed=opts.seed)
    return Loader(batches, f"readers.make_loader(device={opts.device!r}); {how_augment}", True, dataset)


def plain_loader(dataset, opts, shuffle: bool):
    return torch.utils.data.DataLoader(dataset, batch_size=opts.batch_size, shuffle=shuffle,
                                       num_workers=opts.workers, pin_memory=opts.device.startswith("cuda"),
                                       persistent_workers=False)


class PackerMap:
    """A packer map-style dataset (FolderDataset, LMDBDataset, HDF5Dataset), read in random
    order (readers.ShuffleSampler, as make_loader shuffles), or in readers.BlockShuffleSampler
    order. Raw reads skip the CRC check: they measure what reading costs; the checked
    measure reads the same way with the check on, as a Dataset does by default."""

    peer = False
    blocks = True

    def __init__(self, fmt: str | None):
        self.fmt = fmt
        self.checks = fmt is not None  # packed records carry a checksum; the folder's files none

    def missing(self, ctx: dict) -> str | None:
        if self.fmt is not None:
            if self.fmt not in FORMATS:
                return f"format {self.fmt!r} not in packer.formats.FORMATS"
            if self.fmt not in ctx["packed"]:
                return f"no {self.fmt} data (packing failed or was skipped)"
        return None

    def augment_description(self) -> str:
        return train_transform()[2]

    def path(self, ctx: dict) -> str:
        return ctx["folder"] if self.fmt is None else ctx["packed"][self.fmt]

    def files(self, ctx: dict) -> list[str]:
        return cache.data_files(self.path(ctx))

    def open(self, ctx: dict, decode: str, transform=None, checked: bool = False):
        options = {"check_crc": False} if decode == "raw" and self.fmt is not None and not checked else {}
        dataset = readers.FolderDataset if self.fmt is None else readers.open_dataset
        return dataset(self.path(ctx), decode=decode, transform=transform, **options)

    def samples(self, ctx: dict, mode: str, seed: int, walk: str = "random", epochs: int | None = 1) -> Iterator:
        dataset = self.open(ctx, *read_setup(mode), checked=mode == "checked")
        reader = getattr(dataset, "reader", None)
        if hasattr(reader, "advise"):
            reader.advise("sequential" if walk == "block" else "random")
        if hasattr(dataset, "open"):
            dataset.open()  # paid once per process, so timed apart (open_s), not in the rate
        # Both samplers are iterated as reading goes, so their read-ahead hints go out in time:
        # random order is make_loader's, a permutation with the next records hinted (none for
        # the folder, whose reader takes no hints).
        order = (readers.BlockShuffleSampler(dataset, seed=seed) if walk == "block"
                 else readers.ShuffleSampler(dataset, seed=seed))

        def run():
            try:
                for epoch in _epochs(epochs):
                    order.set_epoch(epoch)
                    for i in order:
                        yield dataset[i][0]
            finally:
                # Unmaps LMDB pages and drops HDF5's chunk cache, so the next run starts cold.
                getattr(dataset, "close", lambda: None)()

        return run()

    def loader(self, ctx: dict, opts) -> Loader:
        transform, decode, how = train_transform()
        # The readers' defaults, as training runs them: packed records' checksums checked (as WDSDataset's are).
        return packer_loader(self.open(ctx, decode, transform, checked=True), opts, how)


class PackerShards:
    """readers.WDSDataset: tar shards streamed in order."""

    peer = False
    fmt = "wds"
    # A training loader shuffles: map-style rows through a random sampler, shards through
    # WDSDataset's buffer (of raw samples, ahead of decoding), which leaves reads sequential.
    TRAIN_SHUFFLE = 1000

    def missing(self, ctx: dict) -> str | None:
        from packer.formats import FORMATS

        if self.fmt not in FORMATS:
            return f"format {self.fmt!r} not in packer.formats.FORMATS"
        if self.fmt not in ctx["packed"]:
            return f"no {self.fmt} data (packing failed or was skipped)"
        return None

    def augment_description(self) -> str:
        return train_transform()[2]

    def files(self, ctx: dict) -> list[str]:
        return cache.data_files(ctx["packed"][self.fmt])

    def open(self, ctx: dict, decode: str, transform=None, shuffle: int = 0, seed: int = 0):
        return readers.WDSDataset(ctx["packed"][self.fmt], decode=decode, transform=transform, shuffle=shuffle,
                                     seed=seed)

    def samples(self, ctx: dict, mode: str, seed: int, walk: str = "random", epochs: int | None = 1) -> Iterator:
        dataset = self.open(ctx, *read_setup(mode))

        def run():
            for epoch in _epochs(epochs):
                dataset.set_epoch(epoch)
                yield from (sample[0] for sample in dataset)

        return run()

    def loader(self, ctx: dict, opts) -> Loader:
        transform, decode, how = train_transform()
        dataset = self.open(ctx, decode, transform, shuffle=self.TRAIN_SHUFFLE, seed=opts.seed)
        return packer_loader(dataset, opts, f"{how}; shuffle buffer {self.TRAIN_SHUFFLE}")


def wds_image(sample: dict):
    for key, value in sample.items():
        if not key.startswith("__") and key.rsplit(".", 1)[-1].lower() in IMAGE_SUFFIXES:
            return value
    raise KeyError(f"{sample.get('__key__')}: no image member (looked for {', '.join(IMAGE_SUFFIXES)})")


def wds_label(sample: dict) -> int:
    for key in ("cls", "label", "cls.txt"):
        if key in sample:
            value = sample[key]
            return int(value.decode() if isinstance(value, bytes) else value)
    return 0


def _wds_train_pair(sample: dict):
    return _uint8_chw(augment_pil(wds_image(sample))), wds_label(sample)


class WebDatasetPeer:
    """The official webdataset library reading packer's wds shards, as its users write it."""

    peer = True
    fmt = "wds"

    def augment_description(self) -> str:
        return PILLOW_AUGMENT

    def missing(self, ctx: dict) -> str | None:
        try:
            import webdataset  # noqa: F401
        except ImportError:
            return "webdataset not installed (pip install webdataset)"
        if self.fmt not in ctx["packed"]:
            return "no wds shards to read (wds was not packed)"
        return None

    def files(self, ctx: dict) -> list[str]:
        return cache.data_files(ctx["packed"][self.fmt])

    def shards(self, ctx: dict) -> list[str]:
        return [p for p in self.files(ctx) if p.endswith(".tar")]

    def pipeline(self, ctx: dict):
        import webdataset

        return webdataset.WebDataset(self.shards(ctx), shardshuffle=False, empty_check=False)

    def samples(self, ctx: dict, mode: str, seed: int, walk: str = "random", epochs: int | None = 1) -> Iterator:
        rng = random.Random(seed)

        def one_epoch():
            if mode == "raw":
                return (wds_image(s) for s in self.pipeline(ctx))
            if mode == "decode":
                return (wds_image(s) for s in self.pipeline(ctx).decode("rgb8"))
            return (_uint8_chw(augment_pil(wds_image(s), rng)) for s in self.pipeline(ctx).decode("pil"))

        return (sample for _ in _epochs(epochs) for sample in one_epoch())

    def loader(self, ctx: dict, opts) -> Loader:
        dataset = self.pipeline(ctx).shuffle(PackerShards.TRAIN_SHUFFLE).decode("pil").map(_wds_train_pair)
        return Loader(plain_loader(dataset, opts, False), f"{PEER_LOADER}; webdataset .shuffle("
                      f"{PackerShards.TRAIN_SHUFFLE}).decode('pil') + Pillow RandomResizedCrop(224) + flip", False)


class PILFolder:
    """A map-style dataset of (path, label) pairs decoded with Pillow: the loop most users run."""

    def __init__(self, items: list[tuple[str, int]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as im:
            image = im.convert("RGB")
        return _uint8_chw(augment_pil(image)), label


class PILListdirPeer:
    """Plain Pillow + os.listdir over SRC/<class>/<file>, no packer code at all."""

    peer = True

    def augment_description(self) -> str:
        return PILLOW_AUGMENT

    def missing(self, ctx: dict) -> str | None:
        return None

    def files(self, ctx: dict) -> list[str]:
        return cache.data_files(ctx["folder"])

    def listing(self, ctx: dict) -> list[tuple[str, int]]:
        root = ctx["folder"]
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        return [(os.path.join(root, c, f), label) for label, c in enumerate(classes)
                for f in sorted(os.listdir(os.path.join(root, c))) if f.lower().endswith(IMAGE_EXTENSIONS)]

    def samples(self, ctx: dict, mode: str, seed: int, walk: str = "random", epochs: int | None = 1) -> Iterator:
        from PIL import Image

        items = self.listing(ctx)
        rng = random.Random(seed)

        def run():
            for i in (i for epoch in _epochs(epochs) for i in _order(len(items), (seed, epoch))):
                path = items[int(i)][0]
                if mode == "raw":
                    with open(path, "rb") as f:
                        yield f.read()
                    continue
                with Image.open(path) as im:
                    image = im.convert("RGB")
                # Augmented output ends as a 3x224x224 uint8 tensor, as packer's transform returns.
                yield np.asarray(image) if mode == "decode" else _uint8_chw(augment_pil(image, rng))

        return run()

    def loader(self, ctx: dict, opts) -> Loader:
        return Loader(plain_loader(PILFolder(self.listing(ctx)), opts, True),
                      f"{PEER_LOADER}; Pillow RandomResizedCrop(224) + flip", False)


# Formats that also stream (their row), beside their map-style Dataset's row "<name> (map)".
STREAMED = {"wds": PackerShards()}


def packer_rows() -> dict:
    """folder, then each packed format in packer.formats.FORMATS order, read by its map-style
    Dataset (readers.open_dataset), or streamed and by index for a format in STREAMED."""
    rows = {"folder": PackerMap(None)}
    for name in FORMATS:
        if name in STREAMED:
            rows[name] = STREAMED[name]
            rows[f"{name} (map)"] = PackerMap(name)  # the same files, by index (wds: through records.bin)
        else:
            rows[name] = PackerMap(name)
    return rows


# Row name -> source; the key is what --formats and the table use. Peers follow packer's rows.
SOURCES = {**packer_rows(), "webdataset (peer)": WebDatasetPeer(), "pil+listdir (peer)": PILListdirPeer()}
