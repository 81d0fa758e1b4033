"""readers.make_loader: defaults, misconfiguration errors, worker init, samplers, fork and spawn."""
import os
import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import readers.loader as L
import readers.ranks as ranks
from packer.pack import pack
from packer.synth import make_corpus
from readers import CUDAPrefetcher, FolderDataset, LMDBDataset, LoaderStats, LoaderWarning, ResizeCenterCrop, make_loader


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader") / "src"
    make_corpus(str(root), classes=2, per_class=5, seed=1)
    return root


@pytest.fixture(scope="module")
def lmdb_path(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("loader-lmdb") / "data.lmdb"
    pack(str(corpus), "lmdb", str(out), workers=1, progress=False)
    return out


class Numbers(tud.Dataset):
    def __init__(self, n=12):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i


class Stream(tud.IterableDataset):
    def __iter__(self):
        for i in range(10):
            yield torch.full((3, 2, 2), i, dtype=torch.uint8), i


class WorkerState(tud.Dataset):
    """Reports, from inside the worker, what worker_init set up."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        info = tud.get_worker_info()
        return (torch.tensor([torch.get_num_threads(), int(os.environ.get("OMP_NUM_THREADS", "0")),
                              info.id if info else -1]),
                torch.tensor([np.random.randint(2**31), random.randrange(2**31)]))


def test_defaults_are_the_fast_ones(monkeypatch):
    monkeypatch.setattr(L.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    loader = make_loader(Numbers(), 4)
    assert loader.num_workers == 6
    assert loader.persistent_workers and not loader.pin_memory and loader.drop_last
    assert loader.prefetch_factor == 2
    assert isinstance(loader.sampler, tud.RandomSampler)
    assert loader.worker_init_fn is not None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert make_loader(Numbers(), 4).num_workers == 1


def test_evaluation_loaders_keep_order_and_the_last_batch():
    loader = make_loader(Numbers(10), 4, train=False, workers=0)
    assert isinstance(loader.sampler, tud.SequentialSampler) and not loader.drop_last
    assert not loader.persistent_workers and loader.prefetch_factor is None
    assert [labels.tolist() for _, labels in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_few_workers_get_a_deeper_prefetch():
    assert make_loader(Numbers(), 4, workers=1).prefetch_factor == 8
    assert make_loader(Numbers(), 4, workers=3).prefetch_factor == 3
    assert make_loader(Numbers(), 4, workers=2, prefetch_factor=5).prefetch_factor == 5


@pytest.mark.parametrize("kwargs,message", [
    (dict(workers=0, persistent_workers=True), "persistent_workers=True needs workers > 0"),
    (dict(workers=0, prefetch_factor=4), "prefetch_factor applies to worker processes"),
    (dict(workers=0, multiprocessing_context="spawn"), "multiprocessing_context applies"),
    (dict(workers=-1), "workers must be an int >= 0"),
    (dict(workers=2, prefetch_factor=0), "prefetch_factor must be >= 1"),
    (dict(device="tpu"), "device must be 'cuda', 'cuda:N' or 'cpu'"),
    (dict(gpu_decode=lambda batch: batch), "gpu_decode .* needs device='cuda'"),
])
def test_misconfigurations_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_loader(Numbers(), 4, **kwargs)


def test_batch_size_must_be_a_positive_int():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            make_loader(Numbers(), bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA errors")
def test_cuda_options_without_cuda_say_so():
    with pytest.raises(RuntimeError, match="CUDA is not available.*device='cpu'.*or None"):
        make_loader(Numbers(), 4, device="cuda")
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        make_loader(Numbers(), 4, pin_memory=True)


def test_iterable_datasets_get_no_sampler_and_refuse_shuffle():
    loader = make_loader(Stream(), 3, workers=0, train=False)
    assert [labels.tolist() for _, labels in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert make_loader(Stream(), 3, workers=0).drop_last
    with pytest.raises(ValueError, match="IterableDataset: it shuffles"):
        make_loader(Stream(), 3, shuffle=True)


def test_distributed_runs_get_a_sampler_whose_epoch_advances(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = make_loader(Numbers(12), 2, workers=0, seed=7)
    sampler = loader.sampler
    assert isinstance(sampler, tud.DistributedSampler)
    assert (sampler.rank, sampler.num_replicas, sampler.seed) == (1, 2, 7)
    assert sampler.shuffle and sampler.drop_last
    epochs = []
    for _ in range(2):
        epochs.append([labels.tolist() for _, labels in loader])
        assert sampler.epoch == len(epochs) - 1
    assert epochs[0] != epochs[1] and len(epochs[0]) == 3
    loader.set_epoch(0)
    assert [labels.tolist() for _, labels in loader] == epochs[0]
    eval_sampler = make_loader(Numbers(12), 2, workers=0, train=False).sampler
    assert not eval_sampler.shuffle and not eval_sampler.drop_last


def test_worker_init_limits_threads_and_seeds_each_worker():
    calls = []
    loader = make_loader(WorkerState(), 1, workers=2, train=False, persistent_workers=False,
                         worker_init_fn=calls.append)
    state, draws = zip(*[(s[0], d[0]) for s, d in loader])
    assert {tuple(s[:2].tolist()) for s in state} == {(1, 1)}
    by_worker = {int(s[2]): d.tolist() for s, d in zip(state, draws)}
    assert set(by_worker) == {0, 1} and by_worker[0] != by_worker[1]


def test_worker_seeds_differ_by_rank_and_are_reproducible(monkeypatch):
    monkeypatch.setattr(L.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(L, "keep_heap", lambda: False)  # this is no worker: leave this process's malloc alone
    draws = {}
    for rank in (0, 1, 0):
        torch.manual_seed(123)
        L.worker_init(0, rank=rank)
        draws.setdefault(rank, []).append((np.random.randint(2**31), random.random(), torch.rand(1).item()))
    assert draws[0][0] == draws[0][1] and draws[0][0] != draws[1][0]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_packed_and_folder_data_load_the_same_under_fork_and_spawn(context, corpus, lmdb_path):
    expected = [(x.clone(), y.clone()) for x, y in make_loader(
        FolderDataset(str(corpus), decode="raw", transform=ResizeCenterCrop(64, 72)), 4, train=False, workers=0)]
    lmdb_data = LMDBDataset(str(lmdb_path), decode="raw", transform=ResizeCenterCrop(64, 72))
    assert len(lmdb_data) == 10  # touch the reader in the parent before the workers start
    lmdb_data[0]
    loader = make_loader(lmdb_data, 4, train=False, workers=2, multiprocessing_context=context)
    for _ in range(2):  # a second epoch reuses the persistent workers
        got = list(loader)
        assert len(got) == len(expected) == 3
        for (x, y), (ex, ey) in zip(got, expected):
            assert x.dtype == torch.uint8 and x.shape[1:] == (3, 64, 64)
            assert torch.equal(x, ex) and torch.equal(y, ey)


def test_a_shuffled_folder_reads_in_its_packed_copys_seeded_order(corpus, lmdb_path):
    """A FolderDataset is shuffled by make_loader's seed, as packed data is: the same
    seed gives the folder and its LMDB copy the same order, a new seed another."""
    folder = FolderDataset(str(corpus), decode="raw", transform=ResizeCenterCrop(64, 72))
    lmdb = LMDBDataset(str(lmdb_path), decode="raw", transform=ResizeCenterCrop(64, 72))
    loaders = [make_loader(dataset, 2, workers=0, seed=seed, drop_last=False)
               for dataset, seed in ((folder, 3), (lmdb, 3), (folder, 4))]
    sampler = loaders[0].sampler
    assert isinstance(sampler, L.ShuffleSampler) and sampler.reader is None  # the folder's reader takes no hints
    orders = [list(loader.sampler) for loader in loaders]
    assert orders[0] == orders[1] != orders[2]
    assert sorted(orders[0]) == list(range(len(folder)))
    for (x, y), (ex, ey) in zip(loaders[0], loaders[1]):  # the same images, in the same batches
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_device_and_stats_wrap_the_loader():
    result = make_loader(Numbers(8), 4, workers=0, device="cpu", mean=(0.5,), std=(0.25,), stats={"window": 2})
    assert isinstance(result, LoaderStats) and isinstance(result.loader, CUDAPrefetcher)
    assert len(result) == 2
    images, labels = next(iter(result))
    assert images.dtype == torch.float32 and labels.dtype == torch.int64


def test_an_initialised_process_group_is_detected(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert ranks.world() == (0, 1)
        assert isinstance(make_loader(Numbers(), 2, workers=0).sampler, tud.RandomSampler)  # one rank: no split
    finally:
        dist.destroy_process_group()
    assert ranks.world() == (0, 1)


def test_choose_order_alone():
    walk = L.choose_order(Numbers(10), None, None, train=True, drop_last=True, seed=0, rank=0, world_size=1)
    assert walk.sampler is None and walk.shuffle is True and walk.access is None  # no packer reader
    walk = L.choose_order(Numbers(10), None, None, train=False, drop_last=False, seed=0, rank=0, world_size=1)
    assert walk.sampler is None and walk.shuffle is False
    walk = L.choose_order(Numbers(10), "block", None, train=True, drop_last=True, seed=0, rank=1, world_size=2)
    assert walk.shuffle is None and walk.sampler.world() == (1, 2) and walk.sampler.shuffle
    walk = L.choose_order(Numbers(10), None, False, train=True, drop_last=True, seed=5, rank=1, world_size=2)
    assert isinstance(walk.sampler, tud.DistributedSampler) and not walk.sampler.shuffle and walk.sampler.drop_last
    with pytest.raises(ValueError, match="order must be one of"):
        L.choose_order(Numbers(10), "zigzag", None, True, True, 0, 0, 1)


def test_worker_policy_alone():
    assert L.worker_policy(0, None, None) == L.WorkerPolicy(0, False, None, None)
    assert L.worker_policy(2, None, None) == L.WorkerPolicy(2, True, 4, None)  # 8 batches in flight
    assert L.worker_policy(16, False, None).prefetch_factor == 2


def test_drop_last_warns_when_it_drops_a_large_share_or_everything():
    with pytest.warns(LoaderWarning, match="drops 29 of 125 samples .23%. from every epoch"):
        make_loader(Numbers(125), 32, workers=0)
    with pytest.warns(LoaderWarning, match="no full batch, so each epoch is empty"):
        loader = make_loader(Numbers(20), 32, workers=0)
    assert list(loader) == []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_loader(Numbers(125), 32, workers=0, drop_last=False)  # asked for every sample
        make_loader(Numbers(130), 32, workers=0)  # 2 of 130 dropped: a small share
        make_loader(Numbers(20), 32, workers=0, train=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_cpu_target_gets_batches_normalised_where_they_are_made(workers):
    from readers.gpu import normalize, normalize_coefficients

    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    plain = list(make_loader(Numbers(12), 4, train=False, workers=workers))
    on_cpu = make_loader(Numbers(12), 4, train=False, workers=workers, device="cpu", mean=mean, std=std,
                         dtype=torch.bfloat16, channels_last=True)
    assert isinstance(on_cpu, CUDAPrefetcher)
    scale, shift = normalize_coefficients(mean, std, 3)
    got = list(on_cpu)
    assert len(got) == len(plain) == 3
    for (images, labels), (raw, raw_labels) in zip(got, plain):
        assert torch.equal(images, normalize(raw, scale, shift, torch.bfloat16, True)) and torch.equal(labels, raw_labels)
        assert images.is_contiguous(memory_format=torch.channels_last)
        # Made in a worker (shared memory), not converted again in this process.
        assert images.is_shared() == (workers > 0)


def test_a_cpu_targets_own_collate_fn_is_normalised_in_the_worker_too():
    def as_dict(batch):
        return {"x": torch.stack([image for image, _ in batch]), "y": [label for _, label in batch]}

    batches = list(make_loader(Numbers(8), 4, train=False, workers=1, collate_fn=as_dict, device="cpu",
                               mean=0.5, std=0.5))
    assert [b["y"] for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for b in batches:
        assert b["x"].dtype == torch.float32 and b["x"].is_shared()
        torch.testing.assert_close(b["x"][:, 0, 0, 0], (torch.tensor(b["y"]) / 255 - 0.5) / 0.5, rtol=0, atol=1e-6)
