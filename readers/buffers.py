"""Where a batch's memory lives, and the batch of encoded images.

allocate: a new batch buffer, in shared memory in a DataLoader worker (so handing it to
the main process copies nothing) or pinned in the main process when asked (so the copy
to the GPU can be asynchronous).

EncodedBatch: a batch's encoded images (JPEG bytes) end to end in one such buffer, with
their offsets: what make_loader's workers hand over for gpu_decode. Its layout, for any
reader: `data` is a 1-D uint8 tensor, `offsets` a 1-D int64 tensor of len(batch) + 1
entries, from 0 to data's length, and image i is data[offsets[i]:offsets[i + 1]].
"""
from __future__ import annotations

import numpy as np
import torch
import torch.utils.data


def allocate(shape, dtype, pin_memory: bool = False) -> torch.Tensor:
    """A new uninitialised tensor: shared in a DataLoader worker; pinned in the main process
    when pin_memory is set and CUDA is available."""
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


class EncodedBatch:
    """A batch of encoded images (a raw dataset's bytes) in one uint8 tensor (the layout above).

    Made in a DataLoader worker (readers.collate.encoded_collate), it is in shared memory,
    so the main process receives it without copying the bytes (a list of bytes is pickled
    through a pipe and rebuilt there: here, 26 ms of the main process's time per batch of
    256 against 7), and it is pinned in one piece. readers.nvjpeg.GPUDecoder decodes it.
    """

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor):
        self.data, self.offsets = data, offsets

    @classmethod
    def of(cls, blobs: list, pin_memory: bool = False) -> "EncodedBatch":
        """The bytes-like objects in blobs, copied once into one new (shared or pinned) buffer."""
        arrays = [np.frombuffer(blob, dtype=np.uint8) for blob in blobs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        data = allocate((int(offsets[-1]),), torch.uint8, pin_memory)
        if arrays:
            np.concatenate(arrays, out=data.numpy())
        return cls(data, torch.from_numpy(offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sizes(self) -> list[int]:
        return self.offsets.diff().tolist()

    def tensors(self) -> list[torch.Tensor]:
        """Each image's bytes as a 1-D uint8 view of data (no copy)."""
        return list(torch.split(self.data, self.sizes()))

    def views(self) -> list[memoryview]:
        """Each image's bytes as a memoryview of data (no copy)."""
        whole = memoryview(self.data.numpy())
        edges = self.offsets.tolist()
        return [whole[start:end] for start, end in zip(edges, edges[1:])]

    def pin_memory(self) -> "EncodedBatch":
        """This batch with its bytes in pinned memory (DataLoader(pin_memory=True) calls this)."""
        return EncodedBatch(self.data.pin_memory(), self.offsets)

    def __repr__(self) -> str:
        return f"EncodedBatch({len(self)} images, {self.data.numel()} bytes)"
