"""What training code imports: Datasets over packed data and raw folders."""
from __future__ import annotations

from .decode import decode_array, decode_pil, decode_tensor
from .folder import FolderDataset
from .hdf5 import HDF5Dataset
from .lmdb import LMDBDataset
from .wds import WDSDataset, WDSMapDataset

# The map-style (random access) Dataset of each packed format, by its CLI name.
MAP_DATASETS = {"lmdb": LMDBDataset, "hdf5": HDF5Dataset, "wds": WDSMapDataset}


def open_dataset(path, split=None, **kwargs):
    """The map-style Dataset for the packed dataset at path, whatever its format."""
    from packer.formats import detect_format

    return MAP_DATASETS[detect_format(path)](path, split, **kwargs)


__all__ = ["MAP_DATASETS", "FolderDataset", "HDF5Dataset", "LMDBDataset", "WDSDataset", "WDSMapDataset",
           "decode_array", "decode_pil", "decode_tensor", "open_dataset"]
