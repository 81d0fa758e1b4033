"""HDF5Dataset: a map-style Dataset over a `packer pack --to hdf5` file."""
from __future__ import annotations

from ._dataset import PackedDataset


class HDF5Dataset(PackedDataset):
    """Records of one split of a packed HDF5 file, in ImageFolder order and labels.

    The file is opened read-only (locking=False, chunk cache off) on first access in each
    process; a handle inherited through fork is closed and reopened, and pickling drops it.
    Set check_crc=False to skip the per-read record checksum check (of the pack's kind, xxh3 or crc32).

    path may be a URL (s3://bucket/x.h5, https://host/x.h5, gs://...; needs
    packer[remote]): storage_options (credentials, endpoint: fsspec's), cache_dir and
    cache_limit (a block cache shared by workers and ranks), block_size (docs/remote.md).
    """

    format = "hdf5"
