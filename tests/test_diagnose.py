"""readers.diagnose on loops with one cause built in: each cause is named, and nothing else is."""
from __future__ import annotations

import io
import os
import re
import threading
import json
import time

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import readers
from conftest import write
from packer import pack
from packer.cores import available_cores


def spin(seconds: float) -> None:
    """CPU work for seconds (a sleep would let another worker use the core)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Costly(Dataset):
    """Samples that cost `cost` seconds of CPU each."""

    def __init__(self, cost: float, n: int = 512):
        self.cost, self.n = cost, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        spin(self.cost)
        return torch.full((3, 16, 16), i % 256, dtype=torch.uint8), i


class RarelySlow(Costly):
    """Every 64th sample costs 80 ms, the rest almost nothing: fast enough on average."""

    def __getitem__(self, i):
        spin(0.08 if i % 64 == 0 else 0.0002)
        return torch.zeros(3, 16, 16, dtype=torch.uint8), i


class Elementwise(Dataset):
    """Samples made by an elementwise op on a large tensor, which torch spreads over its
    intra-op threads."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.exp(torch.ones(1_000_000)).sum(), i


def sleep_step(seconds: float):
    return lambda batch: time.sleep(seconds)


def slow_start(worker_id: int) -> None:
    time.sleep(0.5)


def many_threads(worker_id: int) -> None:
    torch.set_num_threads(3)


def settings_named(diagnosis) -> list:
    return [f.setting for f in diagnosis.findings]


def test_a_costly_dataset_without_workers_is_named():
    loader = DataLoader(Costly(0.004), batch_size=4, num_workers=0)
    d = readers.diagnose(loader, sleep_step(0.002), steps=12, epochs=1)
    assert d.limit == "data" and d.wait_fraction > 0.5
    assert settings_named(d) == ["num_workers"]
    assert d.figures["batch_cost_ms"] >= 4 * 4  # four samples of at least 4 ms each
    assert f"num_workers={min(available_cores(), 10)}" in d.findings[0].fix or "num_workers=" in d.findings[0].fix
    assert "main process" in d.findings[0].evidence
    json.dumps(d.to_dict())


def test_workers_restarted_every_epoch_are_named():
    loader = DataLoader(Costly(0.0002), batch_size=4, num_workers=2, worker_init_fn=slow_start,
                        persistent_workers=False)
    d = readers.diagnose(loader, sleep_step(0.04), steps=8, epochs=3)
    assert d.limit == "data"
    assert settings_named(d) == ["persistent_workers"]
    assert "persistent_workers=True" in d.findings[0].fix
    assert d.figures["start_ms"] >= 500


def test_persistent_workers_are_not_blamed_for_the_first_start():
    loader = DataLoader(Costly(0.0002), batch_size=4, num_workers=2, worker_init_fn=slow_start,
                        persistent_workers=True)
    d = readers.diagnose(loader, sleep_step(0.02), steps=8, epochs=3)
    assert settings_named(d) == []


def test_a_queue_that_drains_on_slow_batches_is_named():
    loader = DataLoader(RarelySlow(0), batch_size=4, num_workers=2, prefetch_factor=2, persistent_workers=True)
    d = readers.diagnose(loader, sleep_step(0.01), steps=64, epochs=1)
    assert d.limit == "data"
    assert settings_named(d) == ["prefetch_factor"], str(d)
    factor = int(d.findings[0].fix.split("prefetch_factor=")[1].split()[0])
    assert factor > 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_step_bound_loop_claims_nothing(workers):
    loader = DataLoader(Costly(0.0001), batch_size=4, num_workers=workers, persistent_workers=workers > 0)
    d = readers.diagnose(loader, sleep_step(0.1), steps=10, epochs=1 + (workers == 0))
    assert d.limit == "step" and d.wait_fraction < 0.1
    assert d.findings == []
    assert "the step is the limit" in str(d)


def test_oversubscribed_threads_are_named():
    cores = available_cores()
    # spawn: a forked worker that starts an OpenMP pool its parent already ran can deadlock
    # in libgomp (seen in a full run); timeout bounds each batch's wait all the same.
    loader = DataLoader(Elementwise(), batch_size=4, num_workers=cores, worker_init_fn=many_threads,
                        persistent_workers=True, multiprocessing_context="spawn", timeout=120)
    d = readers.diagnose(loader, steps=40, epochs=1)
    assert settings_named(d) == ["threads"], str(d)
    assert d.figures["busy_threads_per_worker"] > 1
    assert "torch.set_num_threads(1)" in d.findings[0].fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning without CUDA needs a machine without CUDA")
def test_pin_memory_without_cuda_is_named_even_when_the_step_is_the_limit():
    loader = DataLoader(Costly(0.0001), batch_size=4, num_workers=0, pin_memory=True)
    d = readers.diagnose(loader, sleep_step(0.03), steps=6, epochs=1)
    assert d.limit == "step"
    assert settings_named(d) == ["pin_memory"] and d.findings[0].fix == "pin_memory=False"


def test_packer_datasets_show_where_each_sample_goes(imagenet_sample):
    ds = readers.FolderDataset(str(imagenet_sample), decode="raw", transform=readers.RandomResizedCrop(64))
    loader = DataLoader(ds, batch_size=8, num_workers=0)
    d = readers.diagnose(loader, sleep_step(0.001), steps=6, epochs=1)
    stages = d.figures["stages_ms"]
    assert set(stages) == {"read", "check", "decode", "transform", "collate", "hand_over"}
    assert stages["check"] == 0  # a folder's files carry no checksum
    assert stages["decode"] < stages["transform"]  # decode="raw" hands bytes on: the crop decodes
    assert settings_named(d) == ["num_workers"]
    assert "inside a worker" in str(d)
    json.dumps(d.to_dict())


def test_packed_records_show_their_checksum_check(imagenet_sample, tmp_path):
    pack(str(imagenet_sample), "lmdb", str(tmp_path / "s.lmdb"))
    ds = readers.LMDBDataset(str(tmp_path / "s.lmdb"), decode="raw", transform=readers.RandomResizedCrop(64))
    d = readers.diagnose(DataLoader(ds, batch_size=8), sleep_step(0.001), steps=4, epochs=1)
    assert d.figures["stages_ms"]["check"] > 0
    ds.close()


def test_make_loader_feeding_a_slow_step_is_left_alone(imagenet_sample):
    ds = readers.FolderDataset(str(imagenet_sample), decode="raw", transform=readers.RandomResizedCrop(64))
    loader = readers.make_loader(ds, batch_size=8, workers=2)
    d = readers.diagnose(loader, sleep_step(0.1), steps=8, epochs=1)
    assert d.limit == "step" and d.findings == []
    assert d.figures["workers"] == 2 and d.figures["persistent_workers"] is True


@pytest.fixture
def large_images(tmp_path):
    """A folder of 1280x960 photos-like JPEGs (smooth gradients): far more pixels than a 224 crop needs."""
    y, x = np.mgrid[0:960, 0:1280]
    for i in range(48):
        pixels = np.stack([(x * (i + 1)) % 256, (y * 3) % 256, (x + y + 10 * i) % 256], -1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        write(tmp_path / "src" / f"c{i % 2}" / f"{i:02d}.jpg", buf.getvalue())
    return tmp_path / "src"


def pil_crop_to_tensor(image):
    """torchvision's RandomResizedCrop(224) + ToTensor, in Pillow and numpy."""
    image = image.resize((224, 224), Image.BILINEAR, box=(0, 0, image.width // 2, image.height // 2))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)


def test_a_full_decode_on_busy_cores_names_the_decode_aware_crop(large_images):
    ds = readers.FolderDataset(str(large_images), transform=pil_crop_to_tensor)
    loader = DataLoader(ds, batch_size=4, num_workers=available_cores(), persistent_workers=True)
    d = readers.diagnose(loader, sleep_step(0.001), steps=10, epochs=1)
    assert settings_named(d) == ["decode"], str(d)
    assert "decode='raw' with readers.RandomResizedCrop(224) (measured here" in d.findings[0].fix


def test_large_stored_images_on_busy_cores_name_max_side(large_images):
    ds = readers.FolderDataset(str(large_images), decode="raw", transform=readers.RandomResizedCrop(224))
    loader = DataLoader(ds, batch_size=4, num_workers=available_cores(), persistent_workers=True)
    d = readers.diagnose(loader, sleep_step(0.001), steps=10, epochs=1)
    assert settings_named(d) == ["max_side"], str(d)
    assert "--max-side 512" in d.findings[0].fix and "1280 px" in d.findings[0].fix


class FromFifo(Dataset):
    """Every sample reads a FIFO that no one writes: a __getitem__ that never returns."""

    def __init__(self, fifo):
        self.fifo = fifo

    def __len__(self):
        return 8

    def __getitem__(self, i):
        with open(self.fifo, "rb") as f:
            return torch.tensor(len(f.read()))


class StreamFromFifo(torch.utils.data.IterableDataset):
    """A stream whose first sample waits on a FIFO that no one writes: a loader that never yields."""

    def __init__(self, fifo):
        self.fifo = fifo

    def __iter__(self):
        with open(self.fifo, "rb") as f:
            yield torch.tensor(len(f.read()))


@pytest.mark.parametrize("kind, stalled", [(FromFifo, r"dataset\[\d+\] \(timed in this process"),
                                           (StreamFromFifo, "batch 0 of epoch 0 from the loader")])
def test_a_wait_that_never_ends_is_named_within_the_timeout(tmp_path, kind, stalled):
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    outcome: list = []

    def run():
        try:
            readers.diagnose(DataLoader(kind(fifo), batch_size=2), steps=2, epochs=1, timeout=1.0)
        except TimeoutError as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run, daemon=True)  # a regression fails here, not hangs the suite
    runner.start()
    runner.join(30)
    try:
        assert not runner.is_alive(), "diagnose still waiting after 30 s"
        assert len(outcome) == 1 and re.search(stalled, str(outcome[0])) and "1 s" in str(outcome[0])
    finally:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer comes and goes: the stalled read ends
