"""readers.collate: one preallocated uint8 batch, shared in workers, clear errors."""
import functools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from readers.collate import collate


def samples(n, shape=(3, 8, 6)):
    return [(torch.full(shape, i, dtype=torch.uint8), i) for i in range(n)]


def test_stacks_images_and_labels():
    images, labels = collate(samples(5))
    assert images.shape == (5, 3, 8, 6) and images.dtype == torch.uint8 and images.is_contiguous()
    assert labels.dtype == torch.int64 and labels.tolist() == [0, 1, 2, 3, 4]
    assert images[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 4]


def test_accepts_numpy_images_in_their_own_layout():
    batch = [(np.full((8, 6, 3), i, dtype=np.uint8), i) for i in range(3)]
    images, _ = collate(batch)
    assert images.shape == (3, 8, 6, 3) and images[2].unique().tolist() == [2]


def test_pinning_is_skipped_without_cuda():
    images, _ = collate(samples(2), pin_memory=True)
    assert images.is_pinned() == torch.cuda.is_available()


def test_refuses_mixed_sizes_naming_the_sample():
    batch = samples(3)
    batch[2] = (torch.zeros(3, 9, 6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match=r"sample 2 is \(3, 9, 6\).*sample 0 is \(3, 8, 6\).*fixed output size"):
        collate(batch)


def test_other_structures_go_to_default_collate():
    batch = [{"image": torch.zeros(2), "label": i} for i in range(3)]
    out = collate(batch)
    assert out["image"].shape == (3, 2) and out["label"].tolist() == [0, 1, 2]
    assert list(collate([(b"raw", 1), (b"jpeg", 2)])[0]) == [b"raw", b"jpeg"]


def test_worker_batches_are_built_in_shared_memory():
    loader = DataLoader(samples(8), batch_size=4, num_workers=1, collate_fn=collate)
    batches = list(loader)
    assert [b[0].is_shared() for b in batches] == [True, True]
    assert torch.equal(batches[1][0][:, 0, 0, 0], torch.tensor([4, 5, 6, 7], dtype=torch.uint8))


def test_a_normalised_batch_equals_the_prefetchers_conversion_of_the_uint8_one():
    from readers import IMAGENET_MEAN, IMAGENET_STD
    from readers.collate import Normalise
    from readers.gpu import normalize, normalize_coefficients

    g = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 256, (3, 8, 6), dtype=torch.uint8, generator=g), i) for i in range(5)]
    raw, _ = collate(batch)
    scale, shift = normalize_coefficients(IMAGENET_MEAN, IMAGENET_STD, 3)
    for dtype in (torch.float32, torch.bfloat16):
        for channels_last in (False, True):
            images, labels = collate(batch, normalise=Normalise(IMAGENET_MEAN, IMAGENET_STD, dtype, channels_last))
            expected = normalize(raw, scale, shift, dtype, channels_last)
            assert images.dtype == dtype and torch.equal(images, expected) and labels.tolist() == [0, 1, 2, 3, 4]
            assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    # Numpy HWC images are stacked as they are, then converted as the prefetcher would take them.
    arrays = [(np.full((4, 4, 3), i, dtype=np.uint8), i) for i in range(2)]
    images, _ = collate(arrays, normalise=Normalise())
    assert images.dtype == torch.float32 and images.shape == (2, 4, 4, 3) and float(images[1].max()) == pytest.approx(1 / 255)


def test_normalise_refuses_bad_settings_up_front():
    from readers.collate import Normalise

    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        Normalise(dtype=torch.uint8)
    with pytest.raises(ValueError, match="std must not contain zeros"):
        Normalise((0.5, 0.5, 0.5), (0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match="one value per channel"):
        Normalise((0.5, 0.5), (0.2, 0.2, 0.2))


def test_worker_batches_are_normalised_in_the_worker_in_shared_memory():
    from readers.collate import Normalise

    batch_fn = functools.partial(collate, normalise=Normalise(0.5, 0.25))
    batches = list(DataLoader(samples(8), batch_size=4, num_workers=1, collate_fn=batch_fn))
    assert [(b[0].dtype, b[0].is_shared()) for b in batches] == [(torch.float32, True)] * 2
    expected = (torch.arange(4, 8, dtype=torch.float32) / 255 - 0.5) / 0.25
    torch.testing.assert_close(batches[1][0][:, 0, 0, 0], expected, rtol=0, atol=1e-6)


def test_an_encoded_batch_holds_each_images_bytes_end_to_end_in_one_buffer():
    from readers.buffers import EncodedBatch

    blobs = [b"\xff\xd8\xffabc", b"", bytearray(b"de"), memoryview(b"fghij")[1:]]
    batch = EncodedBatch.of(blobs)
    assert len(batch) == 4 and batch.sizes() == [6, 0, 2, 4] and batch.data.numel() == 12
    assert [bytes(v) for v in batch.views()] == [bytes(b) for b in blobs]
    tensors = batch.tensors()
    assert [bytes(t.numpy()) for t in tensors] == [bytes(b) for b in blobs]
    # views of the one buffer, not copies
    base = batch.data.data_ptr()
    assert [t.data_ptr() - base for t in tensors if t.numel()] == [0, 6, 8]
    assert len(EncodedBatch.of([])) == 0 and EncodedBatch.of([]).views() == []


def test_encoded_collate_batches_bytes_and_passes_anything_else_to_collate():
    from readers.buffers import EncodedBatch
    from readers.collate import encoded_collate

    encoded, labels = encoded_collate([(b"ab", 3), (b"cde", 1)])
    assert isinstance(encoded, EncodedBatch) and [bytes(v) for v in encoded.views()] == [b"ab", b"cde"]
    assert labels.dtype == torch.int64 and labels.tolist() == [3, 1]
    images, labels = encoded_collate(samples(2))
    assert images.shape == (2, 3, 8, 6) and labels.tolist() == [0, 1]


def test_encoded_batches_cross_from_a_spawned_worker_in_shared_memory(image_tree, tmp_path):
    from packer.pack import pack
    from readers import LMDBDataset
    from readers.buffers import EncodedBatch
    from readers.collate import encoded_collate

    out = tmp_path / "data.lmdb"
    pack(str(image_tree), "lmdb", str(out), workers=1, progress=False)
    dataset = LMDBDataset(str(out), decode="raw")
    loader = DataLoader(dataset, batch_size=8, num_workers=1, multiprocessing_context="spawn",
                        collate_fn=functools.partial(encoded_collate, pin_memory=False))
    got, labels = [], []
    for encoded, label in loader:
        assert isinstance(encoded, EncodedBatch) and encoded.data.is_shared()
        got += [bytes(view) for view in encoded.views()]
        labels += label.tolist()
    assert got == [dataset.reader.read_image(i)[0] for i in range(len(dataset))]
    assert labels == dataset.targets.tolist()
