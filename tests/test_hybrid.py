"""Hybrid decode (readers.hybrid): batches split between real DataLoader workers and a
stand-in engine (a real callable decoding on the CPU at a throttled rate, standing in for
nvJPEG), the split tuned online from the rates each side measures."""
import math
import random
import time

import pytest
import torch

from readers import LMDBDataset, make_loader
from readers.hybrid import HybridDecoder, SharedFraction, SplitTuner, split_count
from readers.transforms import ResizeCenterCrop

TRANSFORM = ResizeCenterCrop(64, 72)


class ThrottledEngine:
    """Decodes an EncodedBatch on the CPU with `transform`, taking at least `per_image` s per image."""

    def __init__(self, transform, per_image: float = 0.0):
        self.transform, self.per_image, self.seen = transform, per_image, 0

    def __call__(self, encoded):
        started = time.perf_counter()
        out = torch.stack([self.transform(bytes(view)) for view in encoded.views()])
        self.seen += len(out)
        time.sleep(max(0.0, self.per_image * len(out) - (time.perf_counter() - started)))
        return out


class SlowTransform:
    """TRANSFORM taking at least `per_image` s: a slow CPU, for the workers' side."""

    def __init__(self, per_image: float):
        self.per_image = per_image

    def __call__(self, data):
        started = time.perf_counter()
        out = TRANSFORM(data)
        time.sleep(max(0.0, self.per_image - (time.perf_counter() - started)))
        return out


@pytest.fixture(scope="module")
def sample_pack(tmp_path_factory):
    """An LMDB pack of 40 of the shared ImageNet photos (one per class)."""
    from conftest import SHARED_DATA
    from packer.pack import pack

    photos = SHARED_DATA / "imagenet-sample"
    if not photos.is_dir():
        pytest.skip(f"{photos} is not present (set PACKER_SHARED_DATA)")
    src = tmp_path_factory.mktemp("photos")
    for folder in sorted(p for p in photos.iterdir() if p.is_dir())[:40]:
        (src / folder.name).mkdir()
        for image in sorted(folder.iterdir()):
            (src / folder.name / image.name).symlink_to(image)
    out = tmp_path_factory.mktemp("pack") / "sample.lmdb"
    pack(str(src), "lmdb", str(out), workers=1, progress=False)
    return str(out)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_hybrid_batches_equal_the_cpu_path_in_order_and_the_workers_follow_the_split(sample_pack, context):
    engine = ThrottledEngine(TRANSFORM, per_image=0.002)
    tuner = SplitTuner(start=0.5, max_step=0.0)  # held, to count what each side decoded
    decoder = HybridDecoder(engine, tuner)
    hybrid = make_loader(LMDBDataset(sample_pack, decode="raw"), 8, device="cpu", train=False, workers=2,
                         multiprocessing_context=context, gpu_decode=decoder)
    cpu = make_loader(LMDBDataset(sample_pack, decode="raw", transform=TRANSFORM), 8, device="cpu", train=False,
                      workers=0)  # the same decode either way: workers only make it slower to start
    expected = list(cpu)
    for fraction, engine_total in ((0.5, 20), (0.25, 20 + 30)):  # 4, then 6 of each batch of 8 to the engine
        tuner.fraction = fraction
        decoder.share.set(fraction)  # read by the (persistent) workers as they make the next epoch's batches
        got = list(hybrid)
        assert len(got) == len(expected) == 5
        for (images, labels), (want, want_labels) in zip(got, expected):
            assert torch.equal(images, want)
            assert labels.tolist() == want_labels.tolist()
        assert engine.seen == engine_total
    assert decoder.tuner.cpu_rate and decoder.tuner.engine_rate


def simulated(tuner: SplitTuner, cpu_rate: float, engine_rate: float, batches: int, n: int = 256,
              workers: int = 16, seed: int = 0) -> list[float]:
    """Feeds the tuner what each side would measure at these rates (10% noise); returns f per batch."""
    draw = random.Random(seed)
    seen = []
    for _ in range(batches):
        k = split_count(tuner.fraction, n)
        cpu_seconds = k * workers / cpu_rate * draw.uniform(0.9, 1.1)
        engine_seconds = (n - k) / engine_rate * draw.uniform(0.9, 1.1)
        seen.append(tuner.observe(k, cpu_seconds, n - k, engine_seconds, workers))
    return seen


@pytest.mark.parametrize("cpu_rate, engine_rate", [(4000.0, 8000.0), (2000.0, 500.0), (300.0, 12000.0)])
def test_the_tuner_converges_to_where_both_sides_finish_together(cpu_rate, engine_rate):
    best = cpu_rate / (cpu_rate + engine_rate)
    seen = simulated(SplitTuner(start=0.5), cpu_rate, engine_rate, 40)
    assert all(abs(f - best) < 0.03 for f in seen[12:]), (best, seen)
    assert max(abs(b - a) for a, b in zip([0.5] + seen, seen)) <= 0.1 + 1e-12  # bounded steps


def test_the_tuner_follows_an_engine_that_slows_down_mid_run():
    tuner = SplitTuner(start=0.5)
    simulated(tuner, 4000.0, 8000.0, 30)
    assert abs(tuner.fraction - 1 / 3) < 0.03
    seen = simulated(tuner, 4000.0, 1000.0, 30, seed=1)  # the engine now 8x slower: f* = 0.8
    assert all(abs(f - 0.8) < 0.03 for f in seen[15:]), seen


def test_a_fixed_split_stays_where_it_is_put():
    assert simulated(SplitTuner(start=0.3, max_step=0.0), 4000.0, 500.0, 10) == [0.3] * 10


@pytest.mark.parametrize("cpu_slow, engine_slow", [(0.0, 0.02), (0.05, 0.0)])
def test_real_workers_move_the_split_towards_the_slower_side_s_partner(sample_pack, cpu_slow, engine_slow):
    """A slow engine (20 ms an image) leaves most of each batch to the workers; slow
    workers (50 ms an image each) leave most of it to the engine."""
    decoder = HybridDecoder(ThrottledEngine(TRANSFORM, engine_slow), SplitTuner(start=0.5),
                            transform=SlowTransform(cpu_slow))
    loader = make_loader(LMDBDataset(sample_pack, decode="raw"), 8, device="cpu", train=False, workers=2,
                         gpu_decode=decoder)
    for _ in range(3):
        for _ in loader:
            pass
    tuner = decoder.tuner
    assert abs(tuner.fraction - tuner.target()) < 0.15, tuner
    assert tuner.fraction > 0.7 if engine_slow else tuner.fraction < 0.3, tuner


def test_real_workers_follow_an_engine_that_speeds_up_mid_run(sample_pack):
    """Slow workers (20 ms an image each); the engine first slower still (50 ms), then as fast
    as it decodes: the split moves from mostly CPU to mostly engine, epoch over epoch."""
    engine = ThrottledEngine(TRANSFORM, 0.05)
    decoder = HybridDecoder(engine, SplitTuner(start=0.5), transform=SlowTransform(0.02))
    loader = make_loader(LMDBDataset(sample_pack, decode="raw"), 8, device="cpu", train=False, workers=2,
                         gpu_decode=decoder)
    for _ in range(2):
        for _ in loader:
            pass
    assert decoder.tuner.fraction > 0.7, decoder.tuner
    engine.per_image = 0.0
    for _ in range(5):
        for _ in loader:
            pass
    assert decoder.tuner.fraction < 0.4, decoder.tuner


@pytest.mark.parametrize("make, message", [
    (lambda: SplitTuner(start=1.5), "SplitTuner: start must be a number in \\[0, 1\\]"),
    (lambda: SplitTuner(start=math.nan), "SplitTuner: start must be a number in \\[0, 1\\]"),
    (lambda: SplitTuner(low=0.8, high=0.2), "low \\(0.8\\) must not exceed high"),
    (lambda: SplitTuner(smoothing=0.0), "smoothing must be above 0"),
    (lambda: SplitTuner(max_step=2), "max_step must be a number in \\[0, 1\\] \\(the most f moves per batch\\)"),
    (lambda: SplitTuner().observe(4, math.nan, 4, 0.1, 2), "cpu_seconds must be a finite number"),
    (lambda: SplitTuner().observe(4, 0.1, 4, -1.0, 2), "engine_seconds must be a finite number"),
    (lambda: SplitTuner().observe(-1, 0.1, 4, 0.1, 2), "cpu_images must be an int >= 0"),
    (lambda: split_count(-0.1, 8), "split_count: fraction must be a number in \\[0, 1\\]"),
    (lambda: SharedFraction(0.5).set(math.inf), "SharedFraction.set must be a number in \\[0, 1\\]"),
])
def test_bad_values_are_refused_with_what_to_pass(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_split_leaves_each_side_an_image_and_bounds_clamp_f():
    assert [split_count(f, 8) for f in (0.0, 0.3, 0.5, 1.0)] == [1, 3, 4, 7]
    assert split_count(0.2, 1) == 1 and split_count(0.0, 1) == 0
    tuner = SplitTuner(start=0.9, low=0.1, high=0.6)
    assert tuner.fraction == 0.6  # a start outside the bounds is clamped to them
    simulated(tuner, 100.0, 100000.0, 20)
    assert tuner.fraction == 0.1


def test_make_loader_hybrid_needs_workers_and_knows_its_spellings(sample_pack):
    dataset = LMDBDataset(sample_pack, decode="raw")
    with pytest.raises(ValueError, match="gpu_decode must be True, False, 'hybrid' or a decoder, not 'hybird'"):
        make_loader(dataset, 8, device="cpu", workers=0, gpu_decode="hybird")
    with pytest.raises(ValueError, match="gpu_decode='hybrid' splits each batch with the DataLoader workers"):
        make_loader(dataset, 8, device="cpu", workers=0, gpu_decode=HybridDecoder(ThrottledEngine(TRANSFORM)))
    with pytest.raises(ValueError, match="decodes the workers' share in its own collate; drop collate_fn"):
        make_loader(dataset, 8, device="cpu", workers=1, gpu_decode=HybridDecoder(ThrottledEngine(TRANSFORM)),
                    collate_fn=list)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        make_loader(dataset, 8, device="cpu", workers=1, gpu_decode="hybrid")
