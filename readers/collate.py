"""Batches (image, label) samples into one uint8 image tensor and one label tensor.

The batch tensor is allocated once per batch, where it will be needed: in a DataLoader
worker, in shared memory (so handing it to the main process copies no pixels); in the
main process, in pinned memory when asked (so the host-to-device copy can be
asynchronous). One torch.stack(out=...) fills it in C++.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import default_collate


def collate(batch, pin_memory: bool = False):
    """(images, labels) from a list of (image, label) pairs of equal-sized uint8 images.

    Images may be tensors or numpy arrays (stacked in the shape they have: CxHxW tensors
    give NxCxHxW). Any other sample structure goes to torch's default_collate.
    Pinning applies only in the main process and only when CUDA is available.
    """
    if not batch or not isinstance(batch[0], (tuple, list)) or len(batch[0]) != 2:
        return default_collate(batch)
    first = batch[0][0]
    if not isinstance(first, (torch.Tensor, np.ndarray)):
        return default_collate(batch)
    images = [torch.as_tensor(sample[0]) for sample in batch]
    labels = [sample[1] for sample in batch]
    if all(isinstance(label, int) for label in labels):
        labels = torch.tensor(labels, dtype=torch.int64)
    else:
        labels = default_collate(labels)
    return stack(images, pin_memory), labels


def stack(images: list, pin_memory: bool = False) -> torch.Tensor:
    """Stack equal-shaped tensors into one new (shared or pinned) buffer."""
    shape, dtype = images[0].shape, images[0].dtype
    for i, image in enumerate(images):
        if image.shape != shape or image.dtype != dtype:
            raise ValueError(
                f"collate: sample {i} is {tuple(image.shape)} {image.dtype} but sample 0 is "
                f"{tuple(shape)} {dtype}; batch images must share one size: use a transform "
                f"with a fixed output size (readers.RandomResizedCrop / readers.ResizeCenterCrop)")
    out = allocate((len(images), *shape), dtype, pin_memory)
    return torch.stack(images, out=out)


def allocate(shape, dtype, pin_memory: bool = False) -> torch.Tensor:
    if torch.utils.data.get_worker_info() is not None:
        # Sending a tensor to the main process moves it to shared memory (a copy), so
        # allocate it there. torch's default_collate does the same through this private
        # call; share_memory_() is the public fallback, slower by a copy of the batch.
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
        if new_shared is None:
            return torch.empty(shape, dtype=dtype).share_memory_()
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return torch.empty(0, dtype=dtype).set_(new_shared(nbytes)).view(shape)
    pin = pin_memory and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, pin_memory=pin)
