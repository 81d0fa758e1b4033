"""LMDBDataset: a map-style Dataset over a `packer pack --to lmdb` database."""
from __future__ import annotations

from packer.formats import lmdb

from ._dataset import ReaderDataset
from .decode import MAX_PIXELS


class LMDBDataset(ReaderDataset):
    """Records of one split of a packed LMDB, in ImageFolder order and labels.

    The environment is opened read-only (lock=False) on first access in each process;
    a handle inherited through fork is closed and reopened, and pickling drops it.
    Set check_crc=False to skip the per-read record checksum check (of the pack's kind, xxh3 or crc32).

    path may be a URL (s3://bucket/x.lmdb, https://host/x.lmdb, gs://...; needs
    packer[remote]): storage_options (credentials, endpoint: fsspec's), cache_dir and
    cache_limit (a block cache shared by workers and ranks), block_size (docs/remote.md).
    """

    def __init__(self, path, split=None, transform=None, target_transform=None, decode="pil",
                 check_crc=True, max_pixels=MAX_PIXELS, storage_options=None, cache_dir=None, cache_limit=None,
                 block_size=None):
        super().__init__(lmdb.Reader(str(path), split, check_crc=check_crc, storage_options=storage_options,
                                     cache_dir=cache_dir, cache_limit=cache_limit, block_size=block_size),
                         transform, target_transform, decode, max_pixels)
