"""LMDBDataset: a map-style Dataset over a `packer pack --to lmdb` database."""
from __future__ import annotations

from ._dataset import PackedDataset


class LMDBDataset(PackedDataset):
    """Records of one split of a packed LMDB, in ImageFolder order and labels.

    The environment is opened read-only (lock=False) on first access in each process;
    a handle inherited through fork is closed and reopened, and pickling drops it.
    Set check_crc=False to skip the per-read record checksum check (of the pack's kind, xxh3 or crc32).

    path may be a URL (s3://bucket/x.lmdb, https://host/x.lmdb, gs://...; needs
    packer[remote]): storage_options (credentials, endpoint: fsspec's), cache_dir and
    cache_limit (a block cache shared by workers and ranks), block_size (docs/remote.md).
    """

    format = "lmdb"
