"""uint8 training and evaluation transforms that choose their crop before decoding.

Given JPEG bytes (a dataset built with decode="raw"), the crop window is drawn from the
size in the JPEG header, the image is decoded at the smallest DCT scale (1, 1/2, 1/4,
1/8) that still leaves the window at least as large as the output, and only the scaled
window is resized, with torch's antialiased bilinear kernel on uint8 (the same filter
as Pillow's and torchvision's antialiased resize). Arrays and tensors are accepted too,
without the decode saving. Output is a contiguous 3xHxW uint8 tensor; converting to
float and normalising is left to the GPU (readers.CUDAPrefetcher). Bytes whose header
claims more than `max_pixels` pixels are refused with CorruptDataError before anything
is decoded, as readers.decode does.

The names mean what they mean in torchvision: RandomResizedCrop crops (flip= adds a
horizontal flip in the same copy), CenterCrop only crops, RandomHorizontalFlip flips,
and ResizeCenterCrop is the usual evaluation pair Resize(256) + CenterCrop(224). Random
draws are torchvision's, in its order (crop, then flip), from the sample's keyed generator
(readers.keyed) when the sample has a key, else from torch's global one, which a
DataLoader seeds per worker: then a seeded run draws what
`Compose([RandomResizedCrop(...), RandomHorizontalFlip()])` would. Every decode path draws
the window from the full image's size and the key, before decoding, so the CPU, nvJPEG
and hybrid paths crop the same window of a sample.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
import torch.nn.functional as F

from .decode import MAX_PIXELS, checked_max_pixels, decode_array, image_size
from .keyed import call_keyed, sample_generator
from .resize import resize_windows, to_uint8

BYTES_TYPES = (bytes, bytearray, memoryview)


@functools.lru_cache(maxsize=16)
def _log_ratio(ratio: tuple[float, float], dtype: torch.dtype) -> tuple[float, float]:
    # torchvision takes the logs in the default dtype; the same rounding keeps the draws identical.
    lo, hi = torch.log(torch.tensor(ratio, dtype=dtype)).tolist()
    return lo, hi


def random_resized_crop_params(height: int, width: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                               generator: torch.Generator | None = None) -> tuple[int, int, int, int]:
    """(top, left, h, w) drawn as torchvision's RandomResizedCrop.get_params draws them.

    Ten tries at an area fraction uniform in `scale` and a log-uniform aspect ratio in
    `ratio`; if none fits, the largest centred crop whose ratio lies within `ratio`.
    """
    area = height * width
    log_lo, log_hi = _log_ratio(tuple(ratio), torch.get_default_dtype())
    draw, pick = scratch_tensors()
    for _ in range(10):
        target_area = area * draw.uniform_(scale[0], scale[1], generator=generator).item()
        aspect = draw.uniform_(log_lo, log_hi, generator=generator).exp_().item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = pick.random_(0, height - h + 1, generator=generator).item()
            left = pick.random_(0, width - w + 1, generator=generator).item()
            return top, left, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


_scratch = threading.local()


def scratch_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's two 1-element tensors for torchvision's draws, made in place: a float of
    the default dtype (torch.empty(1)) and an int64 (torch.randint is empty().random_(low,
    high)). The same kernels consume the generator as new tensors do, without an allocation
    per draw."""
    found = getattr(_scratch, "tensors", None)
    if found is None or found[0].dtype != torch.get_default_dtype():
        found = _scratch.tensors = (torch.empty(1), torch.empty(1, dtype=torch.int64))
    return found


def flip_drawn(p: float, generator: torch.Generator | None = None) -> bool:
    """torchvision's `torch.rand(1) < p` (rand is empty(1).uniform_(0, 1)), compared as torch
    compares it: in the tensor's dtype, so p is rounded to it first."""
    draw = scratch_tensors()[0].uniform_(0, 1, generator=generator)
    return draw.item() < _in_dtype(p, draw.dtype)


@functools.lru_cache(maxsize=64)
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    return torch.tensor(value, dtype=dtype).item()


def as_chw(image) -> torch.Tensor:
    """A CxHxW uint8 tensor view of an HxWxC / HxW array, a PIL image or a CxHxW tensor."""
    if isinstance(image, torch.Tensor):
        return image if image.ndim == 3 else image.unsqueeze(0)
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)


def _batch_of_one(image: torch.Tensor) -> torch.Tensor:
    """A 1xCxHxW view of a CxHxW tensor whose batch stride spans the whole image.

    torch infers the memory format from all four strides. unsqueeze(0) on a CHW view of
    HWC memory gives a batch stride of C, so interpolate takes the input for NCHW and
    skips its channels-last uint8 kernel, which is markedly slower.
    """
    span = max(stride * size for stride, size in zip(image.stride(), image.shape))
    return image.as_strided((1, *image.shape), (span, *image.stride()), image.storage_offset())


def resize_view(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of a CxHxW uint8 tensor, in the memory order torch's kernel wrote.

    That is HWC order for the decoder's HxWxC arrays: callers crop or flip it, then make
    it contiguous once.
    """
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    if image.device.type == "cpu":  # torch has a dedicated uint8 kernel on the CPU (Pillow's algorithm)
        return F.interpolate(_batch_of_one(image), size=size, mode="bilinear", align_corners=False,
                             antialias=True)[0]
    return to_uint8(resized_float(image, size))[0]


def resized_float(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The GPU's resize before rounding: a CxHxW uint8 tensor in, a 1xCxhxw float tensor out
    (no resize when the size already matches, as resize_view does)."""
    batch = _batch_of_one(image).float()
    if tuple(image.shape[-2:]) == tuple(size):
        return batch
    return F.interpolate(batch, size=size, mode="bilinear", align_corners=False, antialias=True)


def flip_some(batch: torch.Tensor, flips: list[bool]) -> torch.Tensor:
    """batch (NxCxHxW) with the images whose flag is set flipped horizontally."""
    if not any(flips):
        return batch
    if all(flips):
        return batch.flip(-1)
    mask = torch.tensor(flips, dtype=torch.bool).view(-1, 1, 1, 1).to(batch.device, non_blocking=True)
    return torch.where(mask, batch.flip(-1), batch)


def transform_batch(transform, images: list, keys: list | None = None) -> torch.Tensor:
    """The uint8 batch of `transform` applied to each CxHxW tensor of `images`, each under
    its sample's key in `keys` (None: unkeyed; see readers.keyed).

    On the GPU a transform with a batched form (RandomResizedCrop, ResizeCenterCrop) draws
    each image's window as calling it would, then resizes, rounds and flips the whole batch
    at once (readers.resize): a fixed number of kernel launches per batch instead of a few
    per image, with the values of calling it image by image, to float rounding.
    """
    keys = [None] * len(images) if keys is None else keys
    batched = getattr(transform, "batch", None)
    if batched is not None and images and images[0].device.type != "cpu":
        return batched(images, keys)
    return torch.stack([call_keyed(key, transform, image) for key, image in zip(keys, images)])


def resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of a CxHxW uint8 tensor; a contiguous copy out."""
    return resize_view(image, size).contiguous()


def _pair(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    h, w = size
    return int(h), int(w)


def _scaled_window(top, left, h, w, full_h, full_w, dec_h, dec_w):
    """The crop window (top, left, h, w) in a decoded image of dec_h x dec_w pixels."""
    sy, sx = dec_h / full_h, dec_w / full_w
    t, b = int(round(top * sy)), int(round((top + h) * sy))
    l, r = int(round(left * sx)), int(round((left + w) * sx))
    t, l = min(t, dec_h - 1), min(l, dec_w - 1)
    return t, l, max(b, t + 1) - t, max(r, l + 1) - l


class RandomResizedCrop:
    """torchvision's RandomResizedCrop: a random area/ratio window, resized to `size`.

    Args:
        flip: also flip horizontally with this probability, drawn after the crop as
            Compose([RandomResizedCrop, RandomHorizontalFlip(flip)]) draws it, in the same
            copy (0, the default, is torchvision's RandomResizedCrop alone).
        dct: on bytes input, decode at a reduced DCT scale when the window allows it.
            Off, the result equals the crop-then-resize of the full decode.
        max_pixels: on bytes input, refuse an image whose header claims more pixels.
    """

    def __init__(self, size=224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.0,
                 dct: bool = True, max_pixels: int = MAX_PIXELS):
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"scale and ratio must be increasing positive pairs, got scale={scale}, ratio={ratio}")
        self.size = _pair(size)
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.flip = flip
        self.dct = dct
        self.max_pixels = checked_max_pixels(max_pixels)

    def __call__(self, image) -> torch.Tensor:
        out_h, out_w = self.size
        if isinstance(image, BYTES_TYPES):
            data = bytes(image)
            full_h, full_w = image_size(data, max_pixels=self.max_pixels)
            (top, left, h, w), flip = self.draw(full_h, full_w)
            need = (math.ceil(out_h * full_h / h), math.ceil(out_w * full_w / w)) if self.dct else None
            decoded = as_chw(decode_array(data, min_size=need, max_pixels=self.max_pixels))
            top, left, h, w = _scaled_window(top, left, h, w, full_h, full_w, *decoded.shape[-2:])
        else:
            decoded = as_chw(image)
            (top, left, h, w), flip = self.draw(*decoded.shape[-2:])
        # Flip after resize() has made the result contiguous: the cheaper order of the two copies.
        out = resize(decoded[:, top:top + h, left:left + w], (out_h, out_w))
        return out.flip(-1) if flip else out

    def batch(self, images: list, keys: list | None = None) -> torch.Tensor:
        """self(image) for each CxHxW GPU tensor, stacked: the same draws in the same order
        (each under its key in `keys`, as transform_batch gives them), every window resized
        at once (readers.resize) and rounded once (see transform_batch). On the CPU,
        transform_batch calls the transform image by image instead: torch's uint8 resize
        there costs a fraction of these matrix products."""
        images = [as_chw(image) for image in images]
        keys = [None] * len(images) if keys is None else keys
        windows, flips = [], []
        for key, image in zip(keys, images):
            window, flip = call_keyed(key, self.draw, *image.shape[-2:])
            windows.append(window)
            flips.append(flip)
        return flip_some(resize_windows(images, windows, self.size, rounded=True), flips)

    def draw(self, height: int, width: int) -> tuple[tuple[int, int, int, int], bool]:
        """(window, flip) for an image of height x width: the crop window (top, left, h, w)
        and whether to flip, from one stream of the sample's key (or torch's global
        generator outside a key). Every decode path calls this with the full image's size."""
        generator = sample_generator()
        window = random_resized_crop_params(height, width, self.scale, self.ratio, generator)
        return window, self.flip > 0 and flip_drawn(self.flip, generator)

    def __repr__(self) -> str:
        ratio = tuple(round(r, 4) for r in self.ratio)
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={ratio}, flip={self.flip}, dct={self.dct})"


def resized_size(height: int, width: int, short: int) -> tuple[int, int]:
    """torchvision's Resize(int): the short side becomes `short`, the long side keeps the ratio (floor)."""
    if height <= width:
        return short, int(short * width / height)
    return int(short * height / width), short


class RandomHorizontalFlip:
    """torchvision's RandomHorizontalFlip(p) on a CxHxW uint8 tensor (one torch.rand draw)."""

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.flip(-1) if flip_drawn(self.p, sample_generator()) else image

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class CenterCrop:
    """torchvision's CenterCrop(size) on uint8: the centre window of the image, padded with
    zeros where the image is smaller than the crop. Bytes are decoded at full size."""

    def __init__(self, size=224, max_pixels: int = MAX_PIXELS):
        self.size = _pair(size)
        self.max_pixels = checked_max_pixels(max_pixels)

    def __call__(self, image) -> torch.Tensor:
        if isinstance(image, BYTES_TYPES):
            image = decode_array(bytes(image), max_pixels=self.max_pixels)
        return center_crop(as_chw(image), self.size).contiguous()

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size})"


def center_crop(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The centre (h, w) window of a CxHxW tensor, zero-padded as torchvision pads it."""
    out_h, out_w = size
    height, width = image.shape[-2:]
    if out_h > height or out_w > width:
        pad_w, pad_h = max(out_w - width, 0), max(out_h - height, 0)
        image = F.pad(image, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
        height, width = image.shape[-2:]
    top, left = int(round((height - out_h) / 2.0)), int(round((width - out_w) / 2.0))
    return image[:, top:top + out_h, left:left + out_w]


class ResizeCenterCrop:
    """The evaluation transform: torchvision's Compose([Resize(resize), CenterCrop(size)]), on uint8.

    On bytes input the JPEG is decoded at the smallest DCT scale whose short side still
    reaches `resize`; the resized size is computed from the full size, as torchvision does.
    Bytes of an image of more than max_pixels pixels are refused before decoding.
    """

    def __init__(self, size=224, resize: int = 256, dct: bool = True, max_pixels: int = MAX_PIXELS):
        self.size = _pair(size)
        self.resize = int(resize)
        self.dct = dct
        self.max_pixels = checked_max_pixels(max_pixels)

    def __call__(self, image) -> torch.Tensor:
        if isinstance(image, BYTES_TYPES):
            data = bytes(image)
            full_h, full_w = image_size(data, max_pixels=self.max_pixels)
            need = (self.resize, self.resize) if self.dct else None
            decoded = as_chw(decode_array(data, min_size=need, max_pixels=self.max_pixels))
        else:
            decoded = as_chw(image)
            full_h, full_w = decoded.shape[-2:]
        new_h, new_w = resized_size(full_h, full_w, self.resize)
        out_h, out_w = self.size
        top, left = self._window(new_h, new_w)
        # Resizing the whole image, then cropping, keeps torchvision's exact sampling grid.
        return resize_view(decoded, (new_h, new_w))[:, top:top + out_h, left:left + out_w].contiguous()

    def batch(self, images: list, keys: list | None = None) -> torch.Tensor:
        """self(image) for each CxHxW GPU tensor, stacked: resized at once (readers.resize),
        rounded once (see transform_batch). It draws nothing, so keys change nothing."""
        images = [as_chw(image) for image in images]
        windows, resized = [], []
        for image in images:
            height, width = image.shape[-2:]
            new_h, new_w = resized_size(height, width, self.resize)
            windows.append((0, 0, height, width))
            resized.append((new_h, new_w, *self._window(new_h, new_w)))
        return resize_windows(images, windows, self.size, resized, rounded=True)

    def _window(self, new_h: int, new_w: int) -> tuple[int, int]:
        """(top, left) of the centre crop in the resized image; refuses a crop larger than it."""
        out_h, out_w = self.size
        if out_h > new_h or out_w > new_w:
            raise ValueError(f"ResizeCenterCrop: crop {self.size} is larger than the {new_h}x{new_w} resized image; "
                             f"use resize >= {max(self.size)}")
        return int(round((new_h - out_h) / 2.0)), int(round((new_w - out_w) / 2.0))

    def __repr__(self) -> str:
        return f"ResizeCenterCrop(size={self.size}, resize={self.resize}, dct={self.dct})"
