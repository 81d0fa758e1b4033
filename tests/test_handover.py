"""readers.buffers.WorkerBatch: a worker's batch, once pinned, gives its shared memory back
(madvise MADV_REMOVE, off the GIL), and nothing the pinned batch or anyone else still reads."""
import mmap
import os
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from packer.formats._io import MADV_REMOVE, advise_pages
from readers.buffers import EncodedBatch, WorkerBatch, give_back, pinned_then_given_back
from readers.collate import collate
from readers.gpu import map_tensors
from readers.loader import batch_collate

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_REMOVE is Linux's")


def samples(n, shape=(3, 64, 64)):
    return [(torch.full(shape, i + 1, dtype=torch.uint8), i) for i in range(n)]


def copied(batch):
    """Pinning's copy without CUDA: the batch in new ordinary memory."""
    def copy(t):
        return torch.empty_like(t).copy_(t)
    if isinstance(batch, tuple) and batch and isinstance(batch[0], EncodedBatch):
        return (EncodedBatch(copy(batch[0].data), batch[0].offsets), copy(batch[1]))
    return map_tensors(batch, copy)


def worker_batches(dataset, collate_fn, **options):
    return list(DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=collate_fn, **options))


@linux
def test_a_workers_batch_arrives_as_a_worker_batch_and_once_copied_its_pages_are_given_back():
    batches = worker_batches(samples(8), batch_collate(None, False, None, give_back=True))
    assert all(isinstance(batch, WorkerBatch) for batch in batches)
    images, labels = batches[1].batch
    assert images.is_shared() and labels.is_shared()
    kept_images, kept_labels = pinned_then_given_back(batches[1].batch, copied)
    assert kept_images[:, 0, 0, 0].tolist() == [5, 6, 7, 8] and kept_images.unique().tolist() == [5, 6, 7, 8]
    assert kept_labels.tolist() == [4, 5, 6, 7]
    # The worker's pages are gone: the mapping still reads, as zeros. The labels fill no
    # whole page, and only whole pages are given back.
    assert images.count_nonzero() == 0 and labels.tolist() == [4, 5, 6, 7]
    assert batches[0].batch[0][:, 0, 0, 0].tolist() == [1, 2, 3, 4]  # another batch is untouched


@linux
def test_a_spawned_workers_batch_is_given_back_too():
    batches = worker_batches(samples(4), batch_collate(None, False, None, give_back=True),
                             multiprocessing_context="spawn")
    images, _ = batches[0].batch
    kept, _ = pinned_then_given_back(batches[0].batch, copied)
    assert kept.unique().tolist() == [1, 2, 3, 4] and images.count_nonzero() == 0


@linux
def test_under_the_file_system_sharing_strategy_the_refcount_page_before_the_data_is_kept():
    """torch's file_system strategy keeps a shared refcount just before a storage's data, in
    the mapping's first page: only whole pages of the data itself may go."""
    import torch.multiprocessing as tmp
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        batches = worker_batches(samples(8), batch_collate(None, False, None, give_back=True))
        images, _ = batches[0].batch
        kept, _ = pinned_then_given_back(batches[0].batch, copied)
        assert kept.unique().tolist() == [1, 2, 3, 4]
        flat = images.flatten()
        first = -(-images.untyped_storage().data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE \
            - images.untyped_storage().data_ptr()
        assert first > 0  # the data starts after the refcount, inside the first page
        assert flat[first:].count_nonzero() < mmap.PAGESIZE  # all but the last partial page
        assert flat[:first].count_nonzero() == first  # the partial first page is left as it was
        del batches, images, flat  # the refcount still works: the storages close cleanly
    finally:
        tmp.set_sharing_strategy(before)


@linux
def test_an_encoded_batch_keeps_the_offsets_its_pinned_copy_still_holds():
    blobs = [bytes([i + 1]) * (5000 * (i + 1)) for i in range(4)]
    batch = (EncodedBatch.of(blobs), torch.arange(4))
    batch[0].data.share_memory_(), batch[0].offsets.share_memory_(), batch[1].share_memory_()
    data = batch[0].data
    pinned, labels = pinned_then_given_back(batch, copied)
    assert [bytes(view) for view in pinned.views()] == blobs  # offsets intact, data copied
    assert labels.tolist() == [0, 1, 2, 3]
    whole = 50000 // mmap.PAGESIZE * mmap.PAGESIZE  # the shared buffer starts on a page
    assert data[:whole].count_nonzero() == 0 and data[whole:].unique().tolist() == [4]
    assert batch[0].offsets.tolist() == [0, 5000, 15000, 30000, 50000]


def test_a_storage_mapped_from_a_file_is_never_given_back(tmp_path):
    """Shared too, but MADV_REMOVE on it would punch a hole in the file on disk."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x07" * (4 * mmap.PAGESIZE))
    mapped = torch.empty(0, dtype=torch.uint8).set_(
        torch.UntypedStorage.from_file(str(path), shared=True, nbytes=4 * mmap.PAGESIZE))
    assert mapped.is_shared() and give_back(mapped) is False
    kept = pinned_then_given_back((mapped,), copied)
    assert torch.equal(kept[0], mapped) and mapped.unique().tolist() == [7]
    assert path.read_bytes() == b"\x07" * (4 * mmap.PAGESIZE)


def test_memory_the_pinned_batch_reaches_through_another_storage_is_kept():
    images = torch.full((4, 3, 64, 64), 9, dtype=torch.uint8).share_memory_()
    tail = torch.from_numpy(images.numpy().reshape(-1)[1024:])  # the same memory, another storage object
    kept = pinned_then_given_back((images,), lambda batch: (tail,))
    assert kept[0].unique().tolist() == [9] and images.unique().tolist() == [9]


@linux
def test_views_of_a_workers_shared_cache_come_through_our_collate_as_new_buffers():
    """A dataset returning views of a shared-memory cache: readers' collate stacks them into a
    new buffer, so giving the batch back never empties the cache."""
    cache = torch.arange(8, dtype=torch.uint8).repeat_interleave(3 * 64 * 64).reshape(8, 3, 64, 64).share_memory_()
    dataset = [(cache[i], i) for i in range(8)]
    for batch in worker_batches(dataset, batch_collate(None, False, None, give_back=True)):
        images, _ = batch.batch
        pinned_then_given_back(batch.batch, copied)
        assert images.count_nonzero() == 0
    assert torch.equal(cache[:, 0, 0, 0], torch.arange(8, dtype=torch.uint8)) and cache[5].unique().tolist() == [5]


def test_a_loader_whose_pinning_was_turned_off_after_it_was_made_gives_plain_batches():
    from readers.loader import EpochLoader
    loader = EpochLoader(samples(8), batch_size=4, num_workers=1,
                         collate_fn=batch_collate(None, False, None, give_back=True))
    got = list(loader)
    assert all(type(batch) is tuple for batch in got)
    assert [images[:, 0, 0, 0].tolist() for images, _ in got] == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_memory_that_is_not_shared_is_left_alone():
    images = torch.ones(4, 3, 64, 64, dtype=torch.uint8)
    assert give_back(images) is False and images.count_nonzero() == images.numel()
    kept, _ = pinned_then_given_back((images, torch.arange(4)), copied)
    assert images.count_nonzero() == images.numel() and torch.equal(kept, images)


def test_a_sparse_tensor_in_a_batch_is_passed_over():
    sparse = torch.eye(3).to_sparse()
    images = torch.ones(2, 3, 64, 64, dtype=torch.uint8)
    kept = pinned_then_given_back({"sparse": sparse, "images": images}, lambda batch: dict(batch))
    assert kept["sparse"] is sparse and torch.equal(kept["sparse"].to_dense(), torch.eye(3))


def test_a_pinned_batch_that_is_the_batch_itself_gives_nothing_back():
    images = torch.ones(2, 3, 64, 64, dtype=torch.uint8).share_memory_()
    assert pinned_then_given_back((images,), lambda batch: batch) == (images,)
    assert images.count_nonzero() == images.numel()


@linux
def test_only_whole_pages_inside_the_range_are_given_back():
    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 5 * page)  # shared anonymous memory: shmem, as a worker's batch is
    view = np.frombuffer(area, dtype=np.uint8)
    view[:] = 1
    address = view.ctypes.data
    assert advise_pages(address + 100, 3 * page, MADV_REMOVE)  # covers pages 1 and 2 whole
    per_page = view.reshape(5, page).min(axis=1).tolist(), view.reshape(5, page).max(axis=1).tolist()
    assert per_page == ([1, 0, 0, 1, 1], [1, 0, 0, 1, 1])
    assert advise_pages(address + 100, page, MADV_REMOVE) is False  # no whole page inside
    del view
    area.close()


def test_a_given_collate_fn_travels_as_it_is_and_a_loader_that_does_not_pin_gets_plain_batches():
    def own(batch):
        return collate(batch)
    assert batch_collate(own, False, None, give_back=True) is own
    plain = worker_batches(samples(4), batch_collate(None, False, None))
    assert isinstance(plain[0], tuple) and plain[0][0].is_shared()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_cuda_the_pin_thread_pins_a_worker_batch_and_gives_its_pages_back():
    batches = worker_batches(samples(8), batch_collate(None, False, None, give_back=True))
    images, _ = batches[1].batch
    pinned = batches[1].pin_memory()
    pinned_images, pinned_labels = pinned
    assert pinned_images.is_pinned() and pinned_labels.is_pinned()
    assert pinned_images.unique().tolist() == [5, 6, 7, 8] and pinned_labels.tolist() == [4, 5, 6, 7]
    assert images.count_nonzero() == 0
    assert batches[1].pin_memory() is pinned  # a second call: the pinned batch, not the emptied one
    loader = DataLoader(samples(8), batch_size=4, num_workers=1, pin_memory=True,
                        collate_fn=batch_collate(None, False, None, give_back=True))
    got = list(loader)  # through torch's own pin thread
    assert all(type(batch) is tuple and batch[0].is_pinned() for batch in got)
    assert [images[:, 0, 0, 0].tolist() for images, _ in got] == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_madvise_is_looked_for_on_linux_alone(monkeypatch):
    from packer.formats import _io
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delattr(os, "uname", raising=False)  # as on Windows: importing must not need it
    assert _io._libc_madvise() is None
