"""What training code imports: Datasets over packed data and raw folders."""
from .decode import decode_array, decode_pil, decode_tensor
from .folder import FolderDataset
from .hdf5 import HDF5Dataset
from .lmdb import LMDBDataset

__all__ = ["FolderDataset", "HDF5Dataset", "LMDBDataset", "decode_array", "decode_pil", "decode_tensor"]
