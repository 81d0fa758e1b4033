"""What training code imports: Datasets over packed data and raw folders, and the loader that feeds a GPU."""
from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # the packer CLI installs without torch; readers needs it
    raise ImportError("readers needs PyTorch, which `pip install packer` leaves out so packing machines stay "
                      "light: install it with `pip install 'packer[readers]'` (or your own torch build, "
                      "then `pip install braceexpand`)") from exc

from .collate import collate
from .diagnose import Diagnosis, Finding, diagnose
from .decode import decode_array, decode_pil, decode_tensor, image_size
from .folder import FolderDataset
from .gpu import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher
from .hdf5 import HDF5Dataset
from .lmdb import LMDBDataset
from .loader import make_loader
from .sampler import BlockShuffleSampler, ShuffleSampler, class_entropy
from .stateful_workers import for_workers
from .stats import LoaderStats, LoaderWarning
from .transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, ResizeCenterCrop
from .wds import WDSDataset, WDSMapDataset

# The map-style (random access) Dataset of each packed format, by its CLI name.
MAP_DATASETS = {"lmdb": LMDBDataset, "hdf5": HDF5Dataset, "wds": WDSMapDataset}


def open_dataset(path, split=None, **kwargs):
    """The map-style Dataset for the packed dataset at path, whatever its format."""
    from packer.formats import detect_format

    return MAP_DATASETS[detect_format(path)](path, split, **kwargs)


__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "MAP_DATASETS", "BlockShuffleSampler", "CUDAPrefetcher", "CenterCrop", "Diagnosis", "Finding",
    "FolderDataset", "HDF5Dataset", "LMDBDataset", "LoaderStats", "LoaderWarning", "RandomResizedCrop",
    "RandomHorizontalFlip", "ResizeCenterCrop", "ShuffleSampler", "WDSDataset", "WDSMapDataset", "class_entropy", "collate", "decode_array", "decode_pil",
    "decode_tensor", "diagnose", "for_workers", "image_size", "make_loader", "open_dataset",
]
