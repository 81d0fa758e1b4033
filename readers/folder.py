"""FolderDataset: an unpacked ImageFolder tree, the baseline every packed format is measured against."""
from __future__ import annotations

from packer.folder import FolderReader

from ._dataset import ReaderDataset
from .decode import MAX_PIXELS


class FolderDataset(ReaderDataset):
    """Images straight from SRC/<class>/<file>, in ImageFolder order and labels.

    Accepts the same layouts as `packer pack` (split folders, unlabeled flat folders).
    """

    def __init__(self, root, split=None, transform=None, target_transform=None, decode="pil",
                 max_pixels=MAX_PIXELS):
        super().__init__(FolderReader(root, split), transform, target_transform, decode, max_pixels)
