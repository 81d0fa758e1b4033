"""GPUDecoder: decodes a batch of JPEG bytes on the GPU with nvJPEG, then crops and resizes there.

An optional path for CUDAPrefetcher(gpu_decode=...) / make_loader(gpu_decode=...):
the dataset yields raw bytes (decode="raw", no transform), workers only read and put
each batch's bytes in one shared buffer (readers.buffers.EncodedBatch), and the GPU
decodes views of it, without a copy, via torchvision.io.decode_jpeg(device="cuda"),
whose batched form uses the A100/H100 hardware JPEG decoders where present. Files
nvJPEG cannot take (CMYK/YCCK JPEGs, PNGs named .JPEG, anything its batch decode
rejects) are decoded on the CPU by readers.decode and moved over, so output is always
RGB. Every image's header size is checked against max_pixels before either decoder
sees it, since nvJPEG would allocate a crafted header's claimed size in GPU memory.
torchvision is imported when a GPUDecoder is built, never at import time.

With `chunk`, a batch is decoded in pieces of that many images on a helper thread while
this thread crops and resizes the piece before: the JPEG engines and the launches of the
resize kernels overlap instead of taking turns.
"""
from __future__ import annotations

import concurrent.futures
import contextlib

import torch

from .buffers import EncodedBatch
from .decode import MAX_PIXELS, checked_jpeg_size, checked_max_pixels, decode_tensor
from .gpu import resolve_device
from .transforms import transform_batch


class GPUDecoder:
    """encoded images -> uint8 NxCxHxW batch on `device`, each through `transform`.

    `transform` takes and returns a CxHxW uint8 tensor of a fixed output size, e.g.
    readers.RandomResizedCrop(224) or readers.ResizeCenterCrop(224); it runs on the GPU,
    batched where it has a batched form. `chunk`: decode pieces of this many images on a
    helper thread, overlapping decode with the resizes (None: the whole batch in one
    decode). An image whose header claims more than max_pixels pixels raises
    CorruptDataError.
    """

    def __init__(self, transform, device="cuda", max_pixels: int = MAX_PIXELS, chunk: int | None = None):
        try:
            from torchvision.io import ImageReadMode, decode_jpeg
        except ImportError as exc:
            raise ImportError("gpu_decode needs torchvision (the build matching your torch, with CUDA); "
                              "without it, decode on the CPU in the workers (decode='raw' with "
                              "readers.RandomResizedCrop)") from exc
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"GPUDecoder: chunk must be a positive number of images or None, not {chunk!r}")
        self.device = resolve_device(device, "GPUDecoder")
        self._decode_jpeg, self._rgb = decode_jpeg, ImageReadMode.RGB
        self.transform = transform
        self.max_pixels = checked_max_pixels(max_pixels)
        self.chunk = chunk
        self._thread = None  # made on first use: a decoder pickled into a worker carries none

    def __call__(self, encoded) -> torch.Tensor:
        """encoded: an EncodedBatch (what make_loader's workers send), or a list of
        bytes-like objects, copied once into one."""
        batch = encoded if isinstance(encoded, EncodedBatch) else EncodedBatch.of(list(encoded))
        views, tensors = batch.views(), batch.tensors()
        keys = batch.keys or [None] * len(views)  # each sample's key: its window is drawn from it
        # Header only, before nvJPEG allocates whatever size a crafted header claims.
        on_gpu = [i for i, data in enumerate(views)
                  if checked_jpeg_size(data, f"image {i} of the batch", self.max_pixels) is not None]
        pieces = [on_gpu[i:i + self.chunk] for i in range(0, len(on_gpu), self.chunk)] if self.chunk else [on_gpu]
        out: list = [None] * len(views)
        if len(pieces) > 1:
            self._pipelined(tensors, pieces, out, keys)
        elif on_gpu:
            images = self._decode_gpu(tensors, on_gpu)
            if len(images) == len(views) and all(image is not None for image in images):
                return transform_batch(self.transform, images, keys)  # the usual batch: nothing to place
            self._place(on_gpu, images, out, keys)
        cpu = [i for i, piece in enumerate(out) if piece is None]
        if cpu:
            decoded = [decode_tensor(bytes(views[i]), f"image {i} of the batch",
                                     max_pixels=self.max_pixels).to(self.device) for i in cpu]
            self._place(cpu, decoded, out, keys)
        return torch.cat(out)

    def _place(self, indices: list, images: list, out: list, keys: list) -> None:
        """Transforms the decoded images (None: left for the CPU decoder), each under its
        key, into out's slots."""
        done = [(i, image) for i, image in zip(indices, images) if image is not None]
        if done:
            batch = transform_batch(self.transform, [image for _, image in done], [keys[i] for i, _ in done])
            for k, (i, _) in enumerate(done):
                out[i] = batch[k:k + 1]

    def _pipelined(self, tensors: list, pieces: list, out: list, keys: list) -> None:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nvjpeg")
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        pending = self._thread.submit(self._decode_on, stream, tensors, pieces[0])
        for k, piece in enumerate(pieces):
            images = pending.result()
            if k + 1 < len(pieces):
                pending = self._thread.submit(self._decode_on, stream, tensors, pieces[k + 1])
            self._place(piece, images, out, keys)

    def _decode_on(self, stream, tensors: list, indices: list) -> list:
        # The caller's stream: the resizes queued on it are ordered after the decode.
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return self._decode_gpu(tensors, indices)

    def _decode_gpu(self, tensors: list, indices: list) -> list:
        """nvJPEG's images for tensors[indices] (1-D uint8 views of the encoded batch);
        None where nvJPEG refuses one (the CPU gets it)."""
        chosen = [tensors[i] for i in indices]
        try:
            return list(self._decode_jpeg(chosen, mode=self._rgb, device=self.device))
        except RuntimeError:
            return [self._one(t) for t in chosen]  # one bad file fails a batch: retry singly

    def _one(self, tensor: torch.Tensor):
        try:
            return self._decode_jpeg(tensor, mode=self._rgb, device=self.device)
        except RuntimeError:
            return None  # the CPU decoder gets it, and raises CorruptDataError if it is broken

    def __getstate__(self):
        return {**self.__dict__, "_thread": None}

    def __repr__(self) -> str:
        chunk = f", chunk={self.chunk}" if self.chunk else ""
        return f"GPUDecoder({self.transform!r}, device={str(self.device)!r}{chunk})"
