"""CUDAPrefetcher: copies batch N+1 to the GPU on a side stream while batch N trains.

How it stays correct, which is where the usual recipe goes wrong:
- one side stream for the prefetcher's lifetime (a stream per epoch fragments the
  caching allocator, which pools memory per stream);
- copies are `non_blocking` from pinned memory, issued on the side stream, and the
  uint8 -> float conversion and normalisation run there too;
- before a batch is handed out, the consumer's current stream waits on the side stream,
  and every handed-out tensor gets `record_stream(consumer)`: without it the allocator
  may give the tensor's memory to the next side-stream copy as soon as the Python
  reference dies, while the consumer's kernels still read it;
- every batch lands in freshly allocated device memory, so a buffer is never
  overwritten while the consumer still uses it.

Without CUDA (device="cpu") the same conversion runs synchronously on the CPU, and the
outputs are identical to the GPU's (the same two IEEE float32 operations per pixel).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from .buffers import EncodedBatch
from .transforms import BYTES_TYPES

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def map_tensors(batch, fn: Callable[[torch.Tensor], Any]):
    """batch with fn applied to every tensor inside tuples, lists, dicts and namedtuples."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, map_tensors(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def normalize_coefficients(mean: Sequence[float] | None, std: Sequence[float] | None,
                           channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel float32 (scale, shift) with x_float = x_uint8 * scale + shift.

    Equals (x / 255 - mean) / std up to float32 rounding; mean and std are in [0, 1]
    units, as torchvision's Normalize takes them. No mean/std gives x / 255.
    """
    mean64 = torch.zeros(channels, dtype=torch.float64) if mean is None else torch.tensor(mean, dtype=torch.float64)
    std64 = torch.ones(channels, dtype=torch.float64) if std is None else torch.tensor(std, dtype=torch.float64)
    if mean64.numel() == 1:
        mean64 = mean64.expand(channels)
    if std64.numel() == 1:
        std64 = std64.expand(channels)
    if mean64.numel() != channels or std64.numel() != channels:
        raise ValueError(f"mean and std need one value per channel ({channels}), got mean={mean}, std={std}")
    if bool((std64 == 0).any()):
        raise ValueError(f"std must not contain zeros, got {std}")
    scale = (1.0 / (255.0 * std64)).to(torch.float32).view(1, channels, 1, 1)
    shift = (-mean64 / std64).to(torch.float32).view(1, channels, 1, 1)
    return scale, shift


def normalize(images: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype=torch.float32,
              channels_last: bool = False) -> torch.Tensor:
    """uint8 NxCxHxW -> normalised float: images * scale + shift (two IEEE ops, no FMA)."""
    # Converted into a contiguous NCHW buffer whatever the batch's layout: a user's collate
    # may hand over channels-last uint8, and on the CPU the per-channel arithmetic is 3x
    # slower in that layout (its innermost dimension is the 3 channels).
    out = torch.empty(images.shape, dtype=torch.float32, device=images.device)
    out.copy_(images).mul_(scale).add_(shift)
    if dtype != torch.float32:
        out = out.to(dtype)
    if channels_last:
        out = out.contiguous(memory_format=torch.channels_last)
    return out


def normalize_into(out: torch.Tensor, image: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> None:
    """out (float32 CxHxW, any strides) = one uint8 CxHxW image * scale + shift: normalize()'s
    two operations on one image, so a batch normalised image by image is identical."""
    torch.mul(image, scale[0], out=out).add_(shift[0])  # the uint8 -> float conversion is exact


def is_image_batch(t: torch.Tensor) -> bool:
    return t.dtype == torch.uint8 and t.ndim == 4


def resolve_device(device, who: str) -> torch.device:
    """device as a torch.device: "cpu", or "cuda"/"cuda:N" when CUDA is available; the one
    check every GPU entry point makes, with one message."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cuda", "cpu"):
        raise ValueError(f"{who}: device must be 'cuda', 'cuda:N' or 'cpu', not {str(device)!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{who}: device={str(device)!r} but CUDA is not available (torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); pass "
                           f"device='cpu' to convert and normalise on the CPU, or None for uint8 batches")
    return resolved


class CUDAPrefetcher:
    """Iterates `loader`, yielding each batch on `device` with uint8 images as normalised floats.

    Every 4-D uint8 tensor in a batch is treated as an NxCxHxW image batch; other tensors
    are moved unchanged. Batches may nest tuples, lists and dicts.

    Args:
        mean, std: per-channel, in [0, 1] units (e.g. readers.IMAGENET_MEAN); None: x / 255.
        channels_last: return images in channels_last memory format (faster convolutions
            with AMP on tensor cores).
        dtype: float dtype of the images (float32, or bfloat16/float16 for AMP).
        gpu_decode: a callable (encoded images -> uint8 NxCxHxW tensor on device) applied
            to a batch's encoded images (a readers.buffers.EncodedBatch, or a list of
            bytes), e.g. readers.nvjpeg.GPUDecoder.
    """

    def __init__(self, loader, device="cuda", mean=None, std=None, channels_last: bool = False,
                 dtype=torch.float32, gpu_decode: Callable | None = None):
        self.loader = loader
        self.device = resolve_device(device, "CUDAPrefetcher")
        self._stream = None
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._stream = torch.cuda.Stream(self.device)
        if not (dtype.is_floating_point if isinstance(dtype, torch.dtype) else False):
            raise ValueError(f"CUDAPrefetcher: dtype must be a floating-point torch.dtype, not {dtype!r}")
        self.mean, self.std = mean, std
        self.channels_last = channels_last
        self.dtype = dtype
        self.gpu_decode = gpu_decode
        self._coefficients: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warned_unpinned = False
        self._read_ahead = False

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_size(self):
        return getattr(self.loader, "batch_size", None)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the loader (readers.make_loader's loaders pass it to their sampler)."""
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The loader's state (readers.make_loader's EpochLoader), less the batch read ahead."""
        return self.loader.state_dict(unconsumed=int(self._read_ahead))

    def load_state_dict(self, state: dict) -> None:
        self._read_ahead = False
        self.loader.load_state_dict(state)

    def __iter__(self):
        self._read_ahead = False
        if self._stream is None:
            for batch in self.loader:
                yield self._convert(batch)
            return
        iterator = iter(self.loader)
        ahead = self._prefetch(iterator)
        while ahead is not None:
            # Read each time: the consumer may switch streams between steps.
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_stream(self._stream)
            batch = ahead[0]
            map_tensors(batch, lambda t: t.record_stream(consumer) if t.is_cuda else None)
            # Queue the next copy before handing this batch out, so it overlaps the step.
            ahead = self._prefetch(iterator)
            self._read_ahead = ahead is not None  # a batch taken from the loader, not yet handed out
            yield batch

    def _prefetch(self, iterator):
        try:
            host_batch = next(iterator)
        except StopIteration:
            return None
        with torch.cuda.stream(self._stream):
            return (self._convert(host_batch),)

    def _convert(self, batch):
        if self.gpu_decode is not None:
            batch = self._decode(batch)
        return map_tensors(batch, self._to_device)

    def _decode(self, batch):
        if not isinstance(batch, (tuple, list)) or not batch:
            return batch
        images = batch[0]
        if isinstance(images, EncodedBatch):
            return type(batch)([self.gpu_decode(images), *batch[1:]])
        if isinstance(images, (list, tuple)) and images and isinstance(images[0], BYTES_TYPES):
            return type(batch)([self.gpu_decode(list(images)), *batch[1:]])
        return batch

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._stream is not None and t.device.type == "cpu" and not t.is_pinned() and not self._warned_unpinned:
            self._warned_unpinned = True
            warnings.warn("CUDAPrefetcher: batches arrive in pageable memory, so copies to the GPU cannot be "
                          "asynchronous; build the loader with pin_memory=True (readers.make_loader does)",
                          stacklevel=3)
        moved = t.to(self.device, non_blocking=True)
        if not is_image_batch(moved):
            return moved
        scale, shift = self._coefficients_for(moved.shape[1])
        return normalize(moved, scale, shift, self.dtype, self.channels_last)

    def _coefficients_for(self, channels: int):
        if channels not in self._coefficients:
            scale, shift = normalize_coefficients(self.mean, self.std, channels)
            # A blocking copy: these small tensors are then ready on every stream.
            self._coefficients[channels] = (scale.to(self.device), shift.to(self.device))
        return self._coefficients[channels]

    def __repr__(self) -> str:
        return (f"CUDAPrefetcher(device={str(self.device)!r}, mean={self.mean}, std={self.std}, "
                f"channels_last={self.channels_last}, dtype={self.dtype})")
