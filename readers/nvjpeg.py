"""GPUDecoder: decodes a batch of JPEG bytes on the GPU with nvJPEG, then crops and resizes there.

An optional path for CUDAPrefetcher(gpu_decode=...) / make_loader(gpu_decode=...):
the dataset yields raw bytes (decode="raw", no transform), workers only read, and the
GPU decodes via torchvision.io.decode_jpeg(device="cuda"). Files nvJPEG cannot take
(CMYK/YCCK JPEGs, PNGs named .JPEG, anything its batch decode rejects) are decoded on
the CPU by readers.decode and moved over, so output is always RGB. Every image's header
size is checked against max_pixels before either decoder sees it, since nvJPEG would
allocate a crafted header's claimed size in GPU memory. torchvision is imported when a
GPUDecoder is built, never at import time.
"""
from __future__ import annotations

import torch

from .decode import MAX_PIXELS, checked_max_pixels, decode_tensor, image_size, turbo_decodable
from .gpu import resolve_device


class GPUDecoder:
    """list of encoded images -> uint8 NxCxHxW batch on `device`, each through `transform`.

    `transform` takes and returns a CxHxW uint8 tensor of a fixed output size, e.g.
    readers.RandomResizedCrop(224) or readers.ResizeCenterCrop(224); it runs on the GPU. An
    image whose header claims more than max_pixels pixels raises CorruptDataError.
    """

    def __init__(self, transform, device="cuda", max_pixels: int = MAX_PIXELS):
        try:
            from torchvision.io import ImageReadMode, decode_jpeg
        except ImportError as exc:
            raise ImportError("gpu_decode needs torchvision (the build matching your torch, with CUDA); "
                              "without it, decode on the CPU in the workers (decode='raw' with "
                              "readers.RandomResizedCrop)") from exc
        self.device = resolve_device(device, "GPUDecoder")
        self._decode_jpeg, self._rgb = decode_jpeg, ImageReadMode.RGB
        self.transform = transform
        self.max_pixels = checked_max_pixels(max_pixels)

    def __call__(self, encoded: list) -> torch.Tensor:
        images: list = [None] * len(encoded)
        on_gpu = [i for i, data in enumerate(encoded) if turbo_decodable(bytes(data))]
        for i in on_gpu:  # header only: nvJPEG would allocate whatever size a crafted header claims
            image_size(bytes(encoded[i]), f"image {i} of the batch", self.max_pixels)
        if on_gpu:
            tensors = [torch.frombuffer(bytearray(encoded[i]), dtype=torch.uint8) for i in on_gpu]
            try:
                decoded = self._decode_jpeg(tensors, mode=self._rgb, device=self.device)
            except RuntimeError:
                decoded = [self._one(t) for t in tensors]  # one bad file fails a batch: retry singly
            for i, image in zip(on_gpu, decoded):
                images[i] = image
        for i, image in enumerate(images):
            if image is None:
                images[i] = decode_tensor(bytes(encoded[i]), f"image {i} of the batch",
                                          max_pixels=self.max_pixels).to(self.device)
        return torch.stack([self.transform(image) for image in images])

    def _one(self, tensor: torch.Tensor):
        try:
            return self._decode_jpeg(tensor, mode=self._rgb, device=self.device)
        except RuntimeError:
            return None  # the CPU decoder gets it, and raises CorruptDataError if it is broken

    def __repr__(self) -> str:
        return f"GPUDecoder({self.transform!r}, device={str(self.device)!r})"
