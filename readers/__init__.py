"""What training code imports: Datasets over packed data and raw folders, and the loader that feeds a GPU."""
from .collate import collate
from .decode import decode_array, decode_pil, decode_tensor, image_size
from .folder import FolderDataset
from .gpu import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher
from .lmdb import LMDBDataset
from .loader import make_loader
from .stats import LoaderStats, LoaderWarning
from .transforms import CenterCrop, RandomResizedCrop

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "CUDAPrefetcher", "CenterCrop", "FolderDataset", "LMDBDataset",
    "LoaderStats", "LoaderWarning", "RandomResizedCrop", "collate", "decode_array", "decode_pil",
    "decode_tensor", "image_size", "make_loader",
]
