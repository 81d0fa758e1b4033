"""What training code imports: Datasets over packed data and raw folders."""
from .decode import decode_array, decode_pil, decode_tensor
from .folder import FolderDataset
from .lmdb import LMDBDataset
from .wds import WDSDataset, WDSMapDataset

__all__ = ["FolderDataset", "LMDBDataset", "WDSDataset", "WDSMapDataset", "decode_array", "decode_pil",
           "decode_tensor"]
