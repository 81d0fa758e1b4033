"""readers.gpu: CUDAPrefetcher's CPU fallback everywhere; stream safety on a real GPU when there is one."""
import collections
import io

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from PIL import Image

from readers import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher, make_loader
from readers.gpu import normalize, normalize_coefficients

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
Pair = collections.namedtuple("Pair", "images labels")


class Images(tud.Dataset):
    """Deterministic uint8 images: sample i is the same wherever and whenever it is built."""

    def __init__(self, n=24, shape=(3, 16, 12)):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g), i


def reference(images, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """The textbook formula, computed synchronously in float64."""
    m = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
    return (images.double() / 255 - m) / s


def test_cpu_fallback_matches_the_synchronous_reference():
    loader = make_loader(Images(), 8, train=False, workers=0)
    prefetcher = CUDAPrefetcher(loader, "cpu", IMAGENET_MEAN, IMAGENET_STD)
    scale, shift = normalize_coefficients(IMAGENET_MEAN, IMAGENET_STD, 3)
    batches = list(prefetcher)
    assert len(batches) == len(prefetcher) == 3
    for (images, labels), (raw, raw_labels) in zip(batches, loader):
        assert images.dtype == torch.float32 and images.device.type == "cpu"
        assert torch.equal(labels, raw_labels)
        assert torch.equal(images, normalize(raw, scale, shift))
        torch.testing.assert_close(images.double(), reference(raw), rtol=0, atol=2e-6)


def test_without_mean_and_std_images_are_scaled_to_unit_range():
    raw = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    (out,) = list(CUDAPrefetcher([raw], "cpu"))
    torch.testing.assert_close(out, raw.float() / 255, rtol=0, atol=1e-7)
    assert out.min() == 0 and out.max() == 1


def test_nested_batches_keep_their_structure():
    images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    batch = {"pair": Pair(images, torch.tensor([1, 2])), "list": [images, "name"], "mask": torch.ones(2, 4, 4)}
    (out,) = list(CUDAPrefetcher([batch], "cpu", mean=0.5, std=0.5))
    assert isinstance(out["pair"], Pair) and out["pair"].images.dtype == torch.float32
    assert bool((out["pair"].images == -1).all()) and out["pair"].labels.tolist() == [1, 2]
    assert out["list"][1] == "name" and out["list"][0].dtype == torch.float32
    assert out["mask"].dtype == torch.float32 and bool((out["mask"] == 1).all())  # only uint8 4-D is an image


def test_options_channels_last_and_dtype():
    loader = make_loader(Images(), 8, train=False, workers=0)
    images, _ = next(iter(CUDAPrefetcher(loader, "cpu", channels_last=True, dtype=torch.bfloat16)))
    assert images.dtype == torch.bfloat16 and images.is_contiguous(memory_format=torch.channels_last)


def test_channels_last_uint8_batches_come_out_in_the_format_asked_for():
    raw = torch.randint(0, 256, (2, 5, 4, 3), dtype=torch.uint8).permute(0, 3, 1, 2)  # NCHW view of NHWC
    for channels_last in (False, True):
        (out,) = list(CUDAPrefetcher([raw], "cpu", IMAGENET_MEAN, IMAGENET_STD, channels_last=channels_last))
        (expected,) = list(CUDAPrefetcher([raw.contiguous()], "cpu", IMAGENET_MEAN, IMAGENET_STD))
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert out.is_contiguous(memory_format=fmt) and torch.equal(out, expected)


def test_early_break_and_reiteration():
    prefetcher = CUDAPrefetcher(make_loader(Images(), 4, train=False, workers=2), "cpu")
    for _ in range(3):
        for i, _ in enumerate(prefetcher):
            if i == 1:
                break
    assert sum(len(labels) for _, labels in prefetcher) == 24


def test_set_epoch_and_attributes_reach_the_loader():
    loader = make_loader(Images(), 4, workers=0)
    prefetcher = CUDAPrefetcher(loader, "cpu")
    prefetcher.set_epoch(5)
    assert loader._next_epoch == 5 and prefetcher.dataset is loader.dataset and prefetcher.batch_size == 4


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="one value per channel"):
        list(CUDAPrefetcher([torch.zeros(1, 3, 2, 2, dtype=torch.uint8)], "cpu", mean=(0.5, 0.5)))
    with pytest.raises(ValueError, match="std must not contain zeros"):
        normalize_coefficients(None, (1.0, 0.0, 1.0), 3)
    with pytest.raises(ValueError, match="device must be 'cuda'"):
        CUDAPrefetcher([], "meta")
    with pytest.raises(ValueError, match="floating-point"):
        CUDAPrefetcher([], "cpu", dtype=torch.uint8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_is_checked_at_construction_not_import():
    assert not torch.cuda.is_initialized()
    with pytest.raises(RuntimeError, match="CUDA is not available.*device='cpu'"):
        CUDAPrefetcher([], "cuda")


@cuda
def test_every_prefetched_batch_equals_a_synchronous_copy_under_allocator_pressure():
    """Catches a missing wait_stream (reads before the copy lands) and a missing
    record_stream (the allocator hands a batch's memory to the next copy while the
    consumer's delayed kernels still read it)."""
    device = torch.device("cuda", torch.cuda.current_device())  # batches arrive on "cuda:N", never bare "cuda"
    dataset = Images(n=64 * 60, shape=(3, 64, 64))
    loader = make_loader(dataset, 64, train=False, workers=2, pin_memory=True)
    scale, shift = (t.to(device) for t in normalize_coefficients(IMAGENET_MEAN, IMAGENET_STD, 3))
    expected = [normalize(images.to(device), scale, shift) for images, _ in loader]
    torch.cuda.synchronize()
    for epoch in range(2):  # the second epoch reuses the prefetcher's one side stream
        early, late = [], []
        prefetcher = CUDAPrefetcher(loader, device, IMAGENET_MEAN, IMAGENET_STD)
        for i, (images, labels) in enumerate(prefetcher):
            early.append((images != expected[i]).sum())  # right away: was the copy waited for?
            torch.cuda._sleep(2_000_000)  # hold the consumer stream back while copies run ahead
            pressure = torch.empty(64 * 3 * 64 * 64 * 4, dtype=torch.uint8, device=device).fill_(255)
            late.append((images != expected[i]).sum())  # after a delay: was the memory protected?
            del pressure
            assert labels.device == device
        torch.cuda.synchronize()
        assert len(early) == len(expected)
        assert [int(x) for x in early] == [0] * len(expected)
        assert [int(x) for x in late] == [0] * len(expected)


@cuda
def test_cuda_outputs_are_identical_to_the_cpu_fallback():
    loader = make_loader(Images(), 8, train=False, workers=0, pin_memory=True)
    for channels_last in (False, True):
        gpu = CUDAPrefetcher(loader, "cuda", IMAGENET_MEAN, IMAGENET_STD, channels_last=channels_last)
        cpu = CUDAPrefetcher(loader, "cpu", IMAGENET_MEAN, IMAGENET_STD, channels_last=channels_last)
        stream = gpu._stream
        for (g, gl), (c, cl) in zip(gpu, cpu):
            assert torch.equal(g.cpu(), c) and torch.equal(gl.cpu(), cl)
        assert gpu._stream is stream


@cuda
def test_early_break_on_cuda_leaves_nothing_behind():
    loader = make_loader(Images(n=256), 8, train=False, workers=2, pin_memory=True)
    prefetcher = CUDAPrefetcher(loader, "cuda")
    torch.cuda.synchronize()
    for _ in range(5):
        for i, _ in enumerate(prefetcher):
            if i == 2:
                break
    assert sum(len(labels) for _, labels in prefetcher) == 256
    torch.cuda.synchronize()


def jpeg(mode, fmt="JPEG", size=(80, 60)):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) \
        .convert(mode).save(buf, fmt)
    return buf.getvalue()


@cuda
def test_gpu_decode_matches_the_cpu_decode_and_falls_back_for_cmyk_and_png():
    pytest.importorskip("torchvision")
    from readers import ResizeCenterCrop
    from readers.nvjpeg import GPUDecoder

    encoded = [jpeg("RGB"), jpeg("L"), jpeg("CMYK"), jpeg("RGB", "PNG")]
    out = GPUDecoder(ResizeCenterCrop(48, 56))(encoded)
    cpu = torch.stack([ResizeCenterCrop(48, 56, dct=False)(data) for data in encoded])
    assert out.shape == (4, 3, 48, 48) and out.dtype == torch.uint8 and out.is_cuda
    # nvJPEG's IDCT and upsampling differ from libjpeg-turbo's by a few levels
    assert (out.cpu().float() - cpu.float()).abs().mean() < 3



def delayed_reads_of_freed_batches() -> list[int]:
    """Per batch, how many values a read queued behind a held-back consumer stream got wrong.

    The consumer never synchronizes: each step spins its stream (torch.cuda._sleep), queues a
    read of the batch behind the spin, and drops the batch. The prefetcher lets go of batch i
    when asked for batch i+1, and at once copies batch i+2 on its side stream, which the
    consumer's spin does not hold back. With record_stream the allocator keeps batch i's
    memory until the consumer's queued read is done; without it the memory goes straight
    back to the side stream's pool, batch i+2 lands in it, and the read sees batch i+2."""
    device = torch.device("cuda")
    # float32 batches of 1.5 MiB come from the allocator's large pool, where a freed block of
    # the same size is the best fit for the next one: the reuse is certain, not likely.
    batches = [torch.full((8, 3, 128, 128), 10 * i, dtype=torch.uint8).pin_memory() for i in range(8)]
    scale, shift = normalize_coefficients(IMAGENET_MEAN, IMAGENET_STD, 3)
    expected = [normalize(b, scale, shift) for b in batches]
    seen = []
    torch.cuda.synchronize()
    for images in CUDAPrefetcher(batches, device, IMAGENET_MEAN, IMAGENET_STD):
        torch.cuda._sleep(20_000_000)  # about 10 ms of the consumer stream spinning
        seen.append(images * 1)  # queued behind the spin: reads the batch's memory later
        del images
    torch.cuda.synchronize()
    return [int((s.cpu() != e).sum()) for s, e in zip(seen, expected)]


@cuda
def test_a_freed_batch_is_not_reused_while_the_consumer_still_reads_it():
    assert delayed_reads_of_freed_batches() == [0] * 8


@cuda
def test_the_check_above_fails_without_record_stream(monkeypatch):
    """The control: with record_stream made a no-op the same steps read overwritten memory, so
    the test above can fail (it does not pass by luck of the allocator)."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    assert sum(delayed_reads_of_freed_batches()) > 0


@cuda
def test_gpu_decode_batched_and_pipelined_equal_the_image_by_image_path():
    """The batched resize (every window at once, one rounding and flip per batch) and the
    decode in pieces on a helper thread change nothing but rounding: with the same seed,
    the uint8 values of decoding with nvJPEG and calling the transform on each image."""
    pytest.importorskip("torchvision")
    from torchvision.io import ImageReadMode, decode_jpeg

    from readers import RandomResizedCrop
    from readers.nvjpeg import GPUDecoder

    encoded = [jpeg("RGB", size=(80 + 7 * i, 60 + 5 * i)) for i in range(10)] + [jpeg("CMYK"), jpeg("L")]
    jpegs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in encoded[:10] + encoded[11:]]
    transform = RandomResizedCrop(48, flip=0.5)
    for chunk in (None, 3):
        # the reference decodes in the same pieces, so nvJPEG's own choices cannot differ
        pieces = [jpegs[i:i + (chunk or len(jpegs))] for i in range(0, len(jpegs), chunk or len(jpegs))]
        nvjpeg = [image for piece in pieces for image in decode_jpeg(piece, mode=ImageReadMode.RGB, device="cuda")]
        torch.manual_seed(5)
        reference = [transform(image) for image in nvjpeg]  # the CMYK one is decoded on the CPU, last
        torch.manual_seed(5)
        out = GPUDecoder(transform, chunk=chunk)(encoded)
        assert out.shape == (12, 3, 48, 48) and out.is_cuda
        # The batch's resize (readers.resize) sums in another order than F.interpolate: a
        # value within float rounding of a half can round the other way (tests/test_resize.py).
        gap = (out[[*range(10), 11]].int() - torch.stack(reference[:10] + reference[10:11]).int()).abs()
        assert gap.max() <= 1 and (gap > 0).float().mean() < 1e-3, chunk


@cuda
def test_make_loader_gpu_decode_hands_pinned_encoded_batches_to_nvjpeg(tmp_path):
    """The whole gpu_decode path on a real pack: workers put each batch's bytes in one
    shared buffer, the pin thread pins it, nvJPEG decodes views of it; the images equal
    the decoder's on a plain list of the same bytes, normalised as the prefetcher does."""
    pytest.importorskip("torchvision")
    from packer.pack import pack
    from readers import LMDBDataset, ResizeCenterCrop
    from readers.buffers import EncodedBatch
    from readers.nvjpeg import GPUDecoder

    for i in range(10):
        path = tmp_path / "src" / f"c{i % 2}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg("RGB", size=(80 + 9 * i, 60 + 4 * i)))
    pack(str(tmp_path / "src"), "lmdb", str(tmp_path / "d.lmdb"), workers=1, progress=False)
    dataset = LMDBDataset(str(tmp_path / "d.lmdb"), decode="raw")
    decoder, handed = GPUDecoder(ResizeCenterCrop(48, 56)), []

    def spy(batch):
        handed.append(isinstance(batch, EncodedBatch) and batch.data.is_pinned())
        return decoder(batch)

    loader = make_loader(dataset, 4, device="cuda", train=False, workers=2, gpu_decode=spy)
    images = torch.cat([images for images, _ in loader])
    assert handed == [True, True, True]
    blobs = [dataset.reader.read_image(i)[0] for i in range(len(dataset))]
    # decoded in the loader's pieces, so nvJPEG's own choices (backend by batch) cannot differ
    expected = torch.cat([decoder(blobs[k:k + 4]) for k in range(0, len(blobs), 4)])
    scale, shift = normalize_coefficients(None, None, 3)
    # The loader resizes on its side stream, where cuBLAS may pick another algorithm for the
    # same products: a value within float rounding of a half can round the other way.
    levels = ((images - normalize(expected, scale.cuda(), shift.cuda())) / scale.cuda().view(1, -1, 1, 1)).abs()
    assert levels.max() <= 1.001 and (levels > 0.5).float().mean() < 1e-3


@cuda
def test_make_loader_hybrid_joins_the_workers_part_and_nvjpeg_s_in_order(tmp_path):
    """gpu_decode="hybrid" on a real pack: the workers' part arrives pinned beside the bytes
    left for nvJPEG; the batch is whole, on the GPU, labels in order, and the tuner measured
    both sides."""
    pytest.importorskip("torchvision")
    from packer.pack import pack
    from readers import LMDBDataset

    for i in range(16):
        path = tmp_path / "src" / f"c{i % 2}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg("RGB", size=(240 + 9 * i, 250 + 4 * i)))
    pack(str(tmp_path / "src"), "lmdb", str(tmp_path / "d.lmdb"), workers=1, progress=False)
    dataset = LMDBDataset(str(tmp_path / "d.lmdb"), decode="raw")
    loader = make_loader(dataset, 8, device="cuda", train=False, workers=2, gpu_decode="hybrid")
    batches = [batch for _ in range(3) for batch in loader]
    assert all(images.shape == (8, 3, 224, 224) and images.is_cuda for images, _ in batches)
    assert torch.cat([labels for _, labels in batches[:2]]).tolist() == dataset.targets.tolist()
    tuner = loader.gpu_decode.tuner
    assert tuner.cpu_rate and tuner.engine_rate and 0 <= tuner.fraction <= 1


@cuda
def test_keyed_gpu_decode_crops_the_cpu_path_s_windows_and_differs_only_by_rounding(capsys):
    """gpu_decode's batches keyed as a loader's workers key them (EncodedBatch.keys) against
    the CPU path's crops of the same samples (dct=False: crop-then-resize of the full decode):
    the same windows and flips, so the pixels differ only by nvJPEG's and the GPU resize's
    rounding, which is printed (docs/reproducibility.md); another seed's crops are far off."""
    pytest.importorskip("torchvision")
    from readers import RandomResizedCrop
    from readers.buffers import EncodedBatch
    from readers.keyed import call_keyed
    from readers.nvjpeg import GPUDecoder

    encoded = [jpeg("RGB", size=(120 + 9 * i, 90 + 4 * i)) for i in range(16)]
    keys = [(7, 0, i) for i in range(16)]
    transform = RandomResizedCrop(48, flip=0.5, dct=False)
    gpu = GPUDecoder(transform)(EncodedBatch.of(encoded, keys=keys)).cpu().int()
    cpu = torch.stack([call_keyed(key, transform, data) for key, data in zip(keys, encoded)]).int()
    other = torch.stack([call_keyed((8, *key[1:]), transform, data) for key, data in zip(keys, encoded)]).int()
    gap, other_gap = (gpu - cpu).abs(), (gpu - other).abs()
    with capsys.disabled():
        print(f"\nkeyed gpu_decode vs CPU: max {int(gap.max())}, mean {gap.float().mean():.3f} levels; "
              f"share of values off {(gap > 0).float().mean():.4f}")
    assert gap.float().mean() < 3 and gap.float().mean() < other_gap.float().mean() / 4
