"""HDF5Dataset: a map-style Dataset over a `packer pack --to hdf5` file."""
from __future__ import annotations

from packer.formats import hdf5

from ._dataset import ReaderDataset
from .decode import MAX_PIXELS


class HDF5Dataset(ReaderDataset):
    """Records of one split of a packed HDF5 file, in ImageFolder order and labels.

    The file is opened read-only (locking=False, chunk cache off) on first access in each
    process; a handle inherited through fork is closed and reopened, and pickling drops it.
    Set check_crc=False to skip the per-read CRC-32 check.
    """

    def __init__(self, path, split=None, transform=None, target_transform=None, decode="pil",
                 check_crc=True, max_pixels=MAX_PIXELS):
        super().__init__(hdf5.Reader(str(path), split, check_crc=check_crc), transform, target_transform,
                         decode, max_pixels)
