"""readers.keyed: augmentation keyed to (seed, epoch, sample index, place), so the batch stream
(index, label, pixels) is the same byte for byte on any number of gloo ranks and worker
processes, through make_loader, torchdata's StatefulDataLoader and a plain DataLoader, and
across a resume on another topology; every decode path crops the same window; the windows
are distributed as torchvision's RandomResizedCrop draws them.

The corpus has one image per class, so a sample's label is its index. The gloo ranks run
this file as a script: `python tests/test_keyed.py ranks JOBFILE RANK`.
"""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers

import readers  # noqa: E402
from readers import KeyedTransform, LMDBDataset, RandomResizedCrop, ShuffleSampler, make_loader  # noqa: E402
from readers.elastic import rank_positions  # noqa: E402
from readers.keyed import KeyedIndex, call_keyed, sample_generator, stream_seed  # noqa: E402

from conftest import jpeg_bytes, write  # noqa: E402
from test_nvjpeg import nvjpeg_calls  # noqa: E402,F401  (a fixture: nvJPEG decoding on the CPU)

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates; nothing of packer's.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

COUNT, BATCH, SEED = 24, 2, 7


class KeyedBrightness:
    """A user's own transform drawing keyed randomness: an offset from readers.sample_generator()."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        offset = torch.randint(-40, 41, (1,), generator=sample_generator()).item()
        return (image.int() + offset).clamp(0, 255).to(torch.uint8)


class GlobalShift:
    """A transform written for torch's global generator (as torchvision's are)."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.roll(int(torch.randint(0, 5, (1,))), dims=-1)


class Pipeline:
    def __init__(self, *steps):
        self.steps = steps

    def __call__(self, image):
        for step in self.steps:
            image = step(image)
        return image


def pipeline():
    return Pipeline(RandomResizedCrop(16, flip=0.5), KeyedBrightness(), KeyedTransform(GlobalShift()))


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> str:
    """COUNT 40x32 JPEGs, one per class, packed as LMDB."""
    from packer.pack import pack as pack_tree

    root = tmp_path_factory.mktemp("keyed")
    for i in range(COUNT):
        write(root / "src" / f"c{i:02d}" / "a.jpg", jpeg_bytes(i, size=(40, 32)))
    pack_tree(str(root / "src"), "lmdb", str(root / "d.lmdb"), workers=1, progress=False)
    return str(root / "d.lmdb")


def samples(batch) -> list[str]:
    """Each sample of a batch as 'label:hash of its pixels'."""
    images, labels = batch
    return [f"{int(label)}:{hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()[:16]}"
            for image, label in zip(images, labels)]


def passes(loader, count: int, sampler=None, first: int = 0) -> list[list[list[str]]]:
    """count passes, each a list of batches of samples(); sampler: set_epoch before each."""
    out = []
    for epoch in range(first, first + count):
        if sampler is not None:
            sampler.set_epoch(epoch)
        out.append([samples(batch) for batch in loader])
    return out


def loader_of(path: str, workers: int):
    return make_loader(LMDBDataset(path, decode="raw", transform=pipeline()), BATCH, workers=workers, seed=SEED,
                       shuffle=True, drop_last=False)


def flat(batches) -> list[str]:
    return [s for batch in batches for s in batch]


def expected_share(reference: list[list[str]], epoch: int, start: int, rank: int, world_size: int) -> list[str]:
    """What `rank` of `world_size` reads of `epoch` in a pass from `start`: the reference's
    global sequence at the rank's places."""
    return [reference[epoch][p] for p in rank_positions(COUNT, start, rank, world_size, False)]


@pytest.fixture(scope="module")
def reference(pack) -> list[list[str]]:
    """Epochs 0 and 1 on 1 rank x 0 workers: the global sequence, sample by sample."""
    got = [flat(p) for p in passes(loader_of(pack, 0), 2)]
    for epoch in got:
        assert sorted(int(s.split(":")[0]) for s in epoch) == list(range(COUNT))  # each sample once
    same = sum(a == b for a, b in zip(sorted(got[0]), sorted(got[1])))
    assert same <= 1  # a sample's pixels differ between epochs: the epoch is in the key
    return got


def test_workers_and_loaders_give_the_same_stream(pack, reference):
    from torchdata.stateful_dataloader import StatefulDataLoader

    assert [flat(p) for p in passes(loader_of(pack, 2), 2)] == reference
    dataset = LMDBDataset(pack, decode="raw", transform=pipeline())
    sampler = ShuffleSampler(dataset, seed=SEED)
    stateful = StatefulDataLoader(dataset, BATCH, sampler=sampler, num_workers=2, persistent_workers=True)
    assert [flat(p) for p in passes(stateful, 2, sampler)] == reference
    sampler = ShuffleSampler(dataset, seed=SEED)
    plain = DataLoader(dataset, BATCH, sampler=sampler, num_workers=1)
    assert [flat(p) for p in passes(plain, 2, sampler)] == reference


@pytest.mark.parametrize("kind", ["threads", "threads-inline"])
def test_thread_workers_give_the_same_stream(pack, reference, kind):
    loader = make_loader(LMDBDataset(pack, decode="raw", transform=pipeline()), BATCH, workers=2, seed=SEED,
                         shuffle=True, drop_last=False, worker_kind=kind)
    assert [flat(p) for p in passes(loader, 2)] == reference


def test_a_stateful_dataloader_resumed_mid_epoch_continues_the_stream(pack, reference):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def build():
        dataset = LMDBDataset(pack, decode="raw", transform=pipeline())
        sampler = ShuffleSampler(dataset, seed=SEED)
        return StatefulDataLoader(dataset, BATCH, sampler=sampler, num_workers=2), sampler

    loader, sampler = build()
    batches = iter(loader)
    head = [samples(next(batches)) for _ in range(5)]
    state = loader.state_dict()
    del batches
    loader, sampler = build()
    loader.load_state_dict(state)
    rest = [samples(batch) for batch in loader]
    assert flat(head + rest) == reference[0]


def stopped(path: str, workers: int, k: int) -> dict:
    """The state of a 1-rank loader after k batches of epoch 0."""
    loader = loader_of(path, workers)
    batches = iter(loader)
    for _ in range(k):
        next(batches)
    state = loader.state_dict()
    del batches
    return state


def resumed_passes(path: str, workers: int, state: dict) -> list[list[str]]:
    """Two passes of a new loader given state: the rest of its epoch, then the next."""
    loader = loader_of(path, workers)
    loader.load_state_dict(state)
    return [flat(p) for p in passes(loader, 2)]


# k batches of 12 on 1 rank: the first, mid-way, before the last, after the last (the next epoch).
STOPS = (1, 6, 11, 12)


def check_resumed(got: list[list[str]], reference, start: int, rank: int, world_size: int, name: str) -> None:
    """A resumed run's two passes: the rest of epoch 0 from `start`, then epoch 1; a state
    saved after the epoch's last batch resumes at epoch 1, then 2 (its first pass checked)."""
    if start >= COUNT:
        assert got[0] == expected_share(reference, 1, 0, rank, world_size), name
        return
    assert got[0] == expected_share(reference, 0, start, rank, world_size), name
    assert got[1] == expected_share(reference, 1, 0, rank, world_size), name


def test_gloo_ranks_and_resumes_on_other_topologies_give_the_same_stream(pack, reference, tmp_path):
    """2 ranks x 2 workers resume 1 x 0's states at each stop and save their own mid-way;
    3 ranks x 1 worker resume that one and 1 x 0's mid-way; 1 x 0 resumes the 2 ranks' too."""
    states = {f"1x0-k{k}": (stopped(pack, 0, k), min(COUNT, k * BATCH)) for k in STOPS}
    for world_size, workers in ((2, 2), (3, 1)):
        job = {"pack": pack, "world_size": world_size, "workers": workers, "group": str(tmp_path / f"g{world_size}"),
               "save": world_size == 2, "resume": {name: state for name, (state, _) in states.items()}}
        path = tmp_path / f"job{world_size}.json"
        path.write_text(json.dumps(job))
        run_ranks(path, world_size)
        for rank in range(world_size):
            got = json.loads((tmp_path / f"job{world_size}.json.{rank}").read_text())
            for epoch in range(2):
                assert got["full"][epoch] == expected_share(reference, epoch, 0, rank, world_size), (world_size, rank)
            for name, (_, start) in states.items():
                check_resumed(got["resumed"][name], reference, start, rank, world_size, f"{name} on {world_size}")
        if world_size == 2:  # rank 0's state after 3 of 6 batches, with 1 x 0's mid-way one
            saved = json.loads((tmp_path / "job2.json.0").read_text())["state"]
            states = {"2x2-k3": (saved, 3 * BATCH * 2), "1x0-k6": states["1x0-k6"]}
    check_resumed(resumed_passes(pack, 0, states["2x2-k3"][0]), reference, 12, 0, 1, "2x2-k3 on 1x0")


def run_ranks(job: Path, world_size: int) -> None:
    procs = [subprocess.Popen([sys.executable, __file__, "ranks", str(job), str(rank)], cwd=HERE.parent,
                              stderr=subprocess.PIPE, text=True) for rank in range(world_size)]
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"rank {rank} of {world_size} failed:\n{err[-4000:]}"


def rank_job(path: str, rank: int) -> None:
    """Script side: one gloo rank runs two whole epochs, saves a state after 3 batches if
    the job says so, and resumes each state of the job."""
    import torch.distributed as dist

    job = json.loads(Path(path).read_text())
    dist.init_process_group("gloo", init_method=f"file://{job['group']}", rank=rank, world_size=job["world_size"])
    try:
        pack, workers = job["pack"], job["workers"]
        record = {"full": [flat(p) for p in passes(loader_of(pack, workers), 2)],
                  "state": stopped(pack, workers, 3) if job["save"] else None,
                  "resumed": {name: resumed_passes(pack, workers, state) for name, state in job["resume"].items()}}
        Path(f"{path}.{rank}").write_text(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def window_recorder(cls=RandomResizedCrop):
    class Recording(cls):
        """A RandomResizedCrop that notes each (window, flip) it draws."""

        drawn: list

        def draw(self, height, width):
            window = super().draw(height, width)
            self.drawn.append(window)
            return window

    crop = Recording(16, flip=0.5, dct=False)
    crop.drawn = []
    return crop


def test_the_batched_gpu_form_draws_each_window_from_its_key():
    """RandomResizedCrop.batch (what the GPU decoders call) draws the windows ds[i]'s call
    draws for the same keys: from the full image's size, before any resize."""
    images = [torch.randint(0, 256, (3, 30 + i, 40 - i), dtype=torch.uint8) for i in range(6)]
    keys = [(SEED, 2, i) for i in range(6)]
    one, batched = window_recorder(), window_recorder()
    for key, image in zip(keys, images):
        call_keyed(key, one, image)
    batched.batch(images, keys)
    assert batched.drawn == one.drawn and len(set(one.drawn)) == 6


def test_cpu_gpu_and_hybrid_decode_crop_the_same_window(pack, nvjpeg_calls):
    """The three decode paths of make_loader, on the CPU with test_nvjpeg's stand-in for nvJPEG
    (the CPU decoder: pixels then differ only where windows do), through 2 worker processes.
    On a GPU, nvJPEG's pixels differ from libjpeg-turbo's by its rounding (docs/reproducibility.md)."""
    from readers.collate import encoded_collate
    from readers.hybrid import HybridDecoder
    from readers.nvjpeg import GPUDecoder

    cpu = make_loader(LMDBDataset(pack, decode="raw", transform=RandomResizedCrop(16, flip=0.5, dct=False)),
                      BATCH, workers=2, seed=SEED, device="cpu")
    expected = [batch for batch in cpu]
    raw = LMDBDataset(pack, decode="raw")
    engine = GPUDecoder(RandomResizedCrop(16, flip=0.5, dct=False), device="cpu")
    sampler = ShuffleSampler(raw, seed=SEED)
    gpu = readers.CUDAPrefetcher(DataLoader(raw, BATCH, sampler=sampler, num_workers=2, drop_last=True,
                                            collate_fn=encoded_collate), device="cpu", gpu_decode=engine)
    hybrid = make_loader(raw, BATCH, workers=2, seed=SEED, device="cpu", gpu_decode=HybridDecoder(engine))
    for name, loader in (("gpu", gpu), ("hybrid", hybrid)):
        got = list(loader)
        assert len(got) == len(expected) == COUNT // BATCH, name
        for (images, labels), (want, want_labels) in zip(got, expected):
            assert torch.equal(labels, want_labels) and torch.equal(images, want), name


def reference_windows(height: int, width: int, draws: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    """(area share, log aspect) of RandomResizedCrop's windows by the algorithm's definition
    (torchvision's get_params), drawn with numpy's generator: nothing of readers in it."""
    rng = np.random.default_rng(0)
    out = np.empty((draws, 2))
    for d in range(draws):
        for _ in range(10):
            area = height * width * rng.uniform(*scale)
            aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
            w, h = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                break
        else:  # the fallback: the whole image, clipped to the ratio range
            in_ratio = width / height
            w, h = ((width, int(round(width / ratio[0]))) if in_ratio < ratio[0]
                    else (int(round(height * ratio[1])), height) if in_ratio > ratio[1] else (width, height))
        out[d] = h * w / (height * width), math.log(w / h)
    return out


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two CDFs."""
    points = np.union1d(a, b)
    cdf_a = np.searchsorted(np.sort(a), points, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), points, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def test_keyed_windows_are_distributed_as_torchvision_draws_them():
    """100,000 keys, one window each, against 100,000 windows of the algorithm's definition
    (or torchvision's own get_params where it is installed): the distributions of area and
    of aspect ratio agree (two-sample KS at alpha = 0.001), and a crop with another scale
    range is told apart by the same test."""
    draws, height, width = 100_000, 375, 500
    crop = RandomResizedCrop(224)
    keyed = np.empty((draws, 2))
    for i in range(draws):
        _, _, h, w = call_keyed((SEED, 0, i), crop.draw, height, width)[0]
        keyed[i] = h * w / (height * width), math.log(w / h)
    try:
        from torchvision.transforms import RandomResizedCrop as Torchvision

        torch.manual_seed(0)
        windows = [Torchvision.get_params(torch.empty(3, height, width), [0.08, 1.0], [3 / 4, 4 / 3])
                   for _ in range(draws)]
        expected = np.array([(h * w / (height * width), math.log(w / h)) for _, _, h, w in windows])
    except ImportError:
        expected = reference_windows(height, width, draws)
    critical = 1.949 * math.sqrt(2 / draws)  # KS at alpha = 0.001, two samples of `draws`
    for column, what in ((0, "area"), (1, "aspect ratio")):
        assert ks_distance(keyed[:, column], expected[:, column]) < critical, what
    other = reference_windows(height, width, draws // 10, scale=(0.12, 1.0))
    assert ks_distance(keyed[:, 0], other[:, 0]) > 1.949 * math.sqrt(11 / draws)


def test_streams_are_keyed_by_every_part_and_by_place():
    def two_draws():
        return [torch.rand(1, generator=sample_generator()).item() for _ in range(2)]

    first, again = call_keyed((SEED, 0, 5), two_draws), call_keyed((SEED, 0, 5), two_draws)
    assert first == again and first[0] != first[1]  # the same key, the same draws; each place its own stream
    others = [call_keyed(key, two_draws) for key in ((SEED + 1, 0, 5), (SEED, 1, 5), (SEED, 0, 6), (SEED, 0, "a", 5))]
    assert len({tuple(d) for d in [first, *others]}) == 5
    assert stream_seed((1, 2, 3), 0) != stream_seed((1, 2, "3"), 0)  # a source's name is not its number
    assert sample_generator() is None  # outside a keyed call: the global generator's to use
    with pytest.raises(TypeError, match="ints and strings"):
        stream_seed((1.5,), 0)


def test_a_keyed_index_is_an_int_that_carries_its_key_through_pickling_and_mixtures():
    import pickle

    index = KeyedIndex(9, (SEED, 4))
    assert index == 9 and [10, 11, 12][index - 8] == 11 and index.key == (SEED, 4, 9)
    assert pickle.loads(pickle.dumps(index)).key == (SEED, 4, 9)
    assert index.within("imagenet", 3).key == (SEED, 4, "imagenet", 3)


def test_keyed_transforms_leave_the_global_generator_alone():
    image = torch.randint(0, 256, (3, 30, 40), dtype=torch.uint8)
    torch.manual_seed(1)
    after = torch.rand(1)
    torch.manual_seed(1)
    for transform in (pipeline(), readers.RandomHorizontalFlip()):
        call_keyed((SEED, 0, 3), transform, image)
    assert torch.equal(torch.rand(1), after)


def test_the_opt_out_draws_from_each_worker_s_generator_as_before(pack):
    """keyed=False: plain indexes, and the draws torch's global generator gives (seeded, the
    same twice in one process; not the keyed stream)."""
    def run():
        torch.manual_seed(3)
        loader = make_loader(LMDBDataset(pack, decode="raw", transform=pipeline()), BATCH, workers=0, seed=SEED,
                             shuffle=True, drop_last=False, keyed=False)
        assert type(next(iter(loader.sampler))) is int
        return [flat(p) for p in passes(loader, 1)]

    first = run()
    assert first == run() and first[0] != flat(passes(loader_of(pack, 0), 1)[0])


def test_a_torchvision_v2_transform_takes_its_parameters_from_the_key(pack):
    v2 = pytest.importorskip("torchvision.transforms.v2", reason="torchvision is not installed here; the keyed "
                             "mechanism it uses (KeyedTransform) is tested with plain callables above")
    transform = KeyedTransform(v2.Compose([v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip()]))
    dataset = LMDBDataset(pack, decode="tensor", transform=transform)
    first = [flat(p) for p in passes(make_loader(dataset, BATCH, workers=0, seed=SEED, shuffle=True,
                                                 drop_last=False), 1)]
    again = [flat(p) for p in passes(make_loader(dataset, BATCH, workers=2, seed=SEED, shuffle=True,
                                                 drop_last=False), 1)]
    assert first == again


if __name__ == "__main__":
    rank_job(sys.argv[2], int(sys.argv[3]))
