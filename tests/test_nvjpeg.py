"""readers.nvjpeg: the optional GPU decode path is import-guarded and refuses clearly without its needs."""
import importlib.util

import pytest
import torch

from readers import ResizeCenterCrop, make_loader


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="checks the no-torchvision error")
def test_gpu_decoder_without_torchvision_says_what_to_install():
    from readers.nvjpeg import GPUDecoder  # importing the module needs neither torchvision nor CUDA

    with pytest.raises(ImportError, match="gpu_decode needs torchvision.*decode on the CPU"):
        GPUDecoder(ResizeCenterCrop(224))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_make_loader_gpu_decode_needs_a_cuda_device():
    with pytest.raises(ValueError, match="gpu_decode decodes on the GPU and needs device='cuda'"):
        make_loader([(b"", 0)], 1, workers=0, gpu_decode=True)
    assert make_loader([(b"", 0)], 1, workers=0, gpu_decode=False) is not None


def test_make_loader_gpu_decode_needs_a_raw_dataset(monkeypatch, tmp_path):
    from readers import FolderDataset, RandomResizedCrop
    import readers.loader

    monkeypatch.setattr(readers.loader.torch.cuda, "is_available", lambda: True)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(b"\xff\xd8\xff")
    for dataset in (FolderDataset(str(tmp_path), decode="pil"),
                    FolderDataset(str(tmp_path), decode="raw", transform=RandomResizedCrop(8))):
        with pytest.raises(ValueError, match="decode='raw' and no transform"):
            make_loader(dataset, 1, workers=0, device="cuda", gpu_decode=True)


def encode(mode, fmt="JPEG", seed=0):
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(buf, fmt)
    return buf.getvalue()


REFUSED = encode("RGB", seed=9)  # the file the stand-in nvJPEG refuses


@pytest.fixture
def nvjpeg_calls(monkeypatch):
    """A stand-in for torchvision's decode_jpeg that decodes on the CPU, refuses REFUSED,
    and fails whole batches that hold it (as nvJPEG does); yields the list of its calls."""
    import sys
    import types

    from readers.decode import decode_tensor

    calls = []

    def decode_jpeg(data, mode=None, device=None):
        batch = isinstance(data, list)
        items = data if batch else [data]
        assert all(t.dtype == torch.uint8 and t.ndim == 1 for t in items)
        calls.append(len(items) if batch else "one")
        if any(bytes(t.numpy()) == REFUSED for t in items):
            raise RuntimeError("nvjpeg: unsupported")
        out = [decode_tensor(bytes(t.numpy())) for t in items]
        return out if batch else out[0]

    fake = types.ModuleType("torchvision.io")
    fake.decode_jpeg, fake.ImageReadMode = decode_jpeg, types.SimpleNamespace(RGB="RGB")
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    monkeypatch.setitem(sys.modules, "torchvision.io", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_gpu_decoder_batches_jpegs_and_falls_back_per_file(nvjpeg_calls):
    """The batching and fallback logic, with the stand-in decoder."""
    from readers.nvjpeg import GPUDecoder

    calls = nvjpeg_calls
    encoded = [encode("RGB", seed=1), encode("L"), encode("CMYK"), encode("RGB", "PNG"), REFUSED]
    out = GPUDecoder(ResizeCenterCrop(32, 36), device="cpu")(encoded)
    expected = torch.stack([ResizeCenterCrop(32, 36)(data) for data in encoded])
    assert out.shape == (5, 3, 32, 32) and torch.equal(out, expected)
    # one batch call for the three turbo-decodable JPEGs... plus the refused one, which fails it;
    # then one call per file; CMYK and PNG never reach the GPU decoder.
    assert calls == [3, "one", "one", "one"]

    # The three JPEGs in pieces of two, decoded on the helper thread: the same batch; the
    # first piece decodes whole, the second (the refused file alone) fails and is retried.
    calls.clear()
    piecewise = GPUDecoder(ResizeCenterCrop(32, 36), device="cpu", chunk=2)
    assert torch.equal(piecewise(encoded), expected)
    assert calls == [2, 1, "one"]
    assert torch.equal(piecewise(encoded[:1]), expected[:1])
    with pytest.raises(ValueError, match="chunk must be a positive number"):
        GPUDecoder(ResizeCenterCrop(32, 36), device="cpu", chunk=0)


def test_gpu_decode_takes_the_workers_shared_batches_of_a_real_pack(nvjpeg_calls, image_tree, tmp_path):
    """make_loader's gpu_decode path end to end, less the GPU: workers read a real LMDB
    pack and hand each batch over as one shared buffer (EncodedBatch); the prefetcher
    gives it to the decoder, whose output is the CPU transform's, image for image."""
    from torch.utils.data import DataLoader

    from packer.pack import pack
    from readers import CUDAPrefetcher, LMDBDataset
    from readers.buffers import EncodedBatch
    from readers.collate import Normalise, encoded_collate
    from readers.nvjpeg import GPUDecoder

    out = tmp_path / "data.lmdb"
    pack(str(image_tree), "lmdb", str(out), workers=1, progress=False)
    dataset = LMDBDataset(str(out), decode="raw")
    seen = []
    loader = DataLoader(dataset, batch_size=5, num_workers=2, collate_fn=encoded_collate)
    decoder = GPUDecoder(ResizeCenterCrop(32, 36), device="cpu")

    def decode(batch):
        assert isinstance(batch, EncodedBatch) and batch.data.is_shared()
        seen.append(len(batch))
        return decoder(batch)

    batches = list(CUDAPrefetcher(loader, device="cpu", gpu_decode=decode))
    n = len(dataset)
    assert seen == [5] * (n // 5) + [n % 5] * (n % 5 > 0)
    assert sum(nvjpeg_calls) == n - 2  # all but the tree's CMYK JPEG and PNG named .JPEG, in batches
    images = torch.cat([images for images, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    expected = torch.stack([ResizeCenterCrop(32, 36)(dataset.reader.read_image(i)[0]) for i in range(len(dataset))])
    assert torch.equal(images, Normalise().batch(expected))  # the prefetcher's x / 255, as it computes it
    assert labels.tolist() == dataset.targets.tolist()
