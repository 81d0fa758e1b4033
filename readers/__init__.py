"""What training code imports: Datasets over packed data and raw folders, and the loader that feeds a GPU."""
from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # the packer CLI installs without torch; readers needs it
    raise ImportError("readers needs PyTorch, which `pip install packer` leaves out so packing machines stay "
                      "light: install it with `pip install 'packer[readers]'` (or your own torch build, "
                      "then `pip install braceexpand`)") from exc

from packer.formats import REMOTE_OPTIONS, detect_format

from ._dataset import PackedDataset
from .collate import collate
from .diagnose import Diagnosis, Finding, diagnose
from .decode import decode_array, decode_pil, decode_tensor, image_size
from .folder import FolderDataset
from .gpu import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher
from .hdf5 import HDF5Dataset
from .keyed import KeyedTransform, sample_generator, sample_seed
from .lmdb import LMDBDataset
from .loader import make_loader
from .mix import Mix, MixSampler
from .sampler import BlockShuffleSampler, ShuffleSampler, class_entropy
from .stateful_workers import for_workers
from .stats import LoaderStats, LoaderWarning
from .transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, ResizeCenterCrop
from .wds import WDSDataset, WDSMapDataset

# Each format's own map-style Dataset class, by its packer.formats.FORMATS name; a format without
# one is read by PackedDataset.
DATASETS = {"lmdb": LMDBDataset, "hdf5": HDF5Dataset, "wds": WDSMapDataset}

def open_dataset(path, split=None, **kwargs):
    """The map-style Dataset for the packed dataset at path, whatever its format: the format's
    own class (DATASETS: LMDBDataset for lmdb), else PackedDataset (a format without one)."""
    remote = {key: kwargs[key] for key in REMOTE_OPTIONS if kwargs.get(key) is not None}
    fmt = detect_format(path, **remote)
    return DATASETS.get(fmt, PackedDataset)(path, split, format=fmt, **kwargs)


__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "BlockShuffleSampler", "CUDAPrefetcher", "CenterCrop", "Diagnosis", "Finding",
    "FolderDataset", "HDF5Dataset", "KeyedTransform", "LMDBDataset", "LoaderStats", "LoaderWarning", "Mix", "MixSampler",
    "PackedDataset", "RandomResizedCrop",
    "RandomHorizontalFlip", "ResizeCenterCrop", "ShuffleSampler", "WDSDataset", "WDSMapDataset", "class_entropy", "collate", "decode_array", "decode_pil",
    "decode_tensor", "diagnose", "for_workers", "image_size", "make_loader", "open_dataset", "sample_generator", "sample_seed",
]
