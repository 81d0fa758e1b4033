"""The samplers' stateless orders are as good as a true permutation: each epoch a
permutation, epochs and seeds differ, no structure a chi-square test sees that it does
not see in torch.randperm, block order mixing classes as well as the stored block
permutation it replaced; and they cost the same few MB on 10^9 records as on 1,000."""
from __future__ import annotations

import math
import os
import tracemalloc

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from benchmarks.processes import memory
from readers import BlockShuffleSampler, ShuffleSampler, class_entropy

from test_sampler import Sized

ALPHA = 0.001  # significance of every chi-square test below (fixed seeds: deterministic)
BINS = 64




def epoch_order(sampler, epoch: int) -> np.ndarray:
    sampler.set_epoch(epoch)
    return np.fromiter(sampler, dtype=np.int64, count=len(sampler))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 65, 1000, 4097])
def test_every_epoch_of_either_order_is_a_permutation(n):
    for epoch in range(3):
        assert sorted(epoch_order(ShuffleSampler(Sized(n), seed=5), epoch).tolist()) == list(range(n))
        for block_size, window in ((1, 1), (4, 3), (8, 16), (64, 16))[n > 100:]:
            order = epoch_order(BlockShuffleSampler(Sized(n), block_size, window, seed=5), epoch)
            assert sorted(order.tolist()) == list(range(n)), (block_size, window)


@pytest.mark.parametrize("kind", [ShuffleSampler, BlockShuffleSampler])
def test_any_positions_of_an_order_are_computed_alone(kind):
    sampler = kind(Sized(5_003), seed=4)
    order = epoch_order(sampler, 2)
    positions = np.random.default_rng(0).integers(0, 5_003, 500)
    assert sampler.order_at(positions).tolist() == order[positions].tolist()
    assert sampler.order_at(np.arange(5_003)).tolist() == order.tolist()


def test_epochs_and_seeds_give_different_orders():
    orders = {tuple(epoch_order(ShuffleSampler(Sized(1000), seed=seed), epoch))
              for seed in range(3) for epoch in range(10)}
    blocks = {tuple(epoch_order(BlockShuffleSampler(Sized(1000), 8, 4, seed=seed), epoch))
              for seed in range(3) for epoch in range(10)}
    assert len(orders) == 30 and len(blocks) == 30


def chi_square_p(counts: np.ndarray) -> float:
    """The chi-square test's p-value of counts against a uniform spread over their bins."""
    expected = counts.sum() / len(counts)
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def structure_p_values(order: np.ndarray) -> dict[str, float]:
    """p-values of what a true permutation of n makes uniform: each position's displacement
    (order[i] - i mod n, uniform on [0, n)), consecutive positions' gap (order[i+1] -
    order[i] mod n, uniform on [1, n)), where consecutive indexes stand (the positions of
    j and j+1, the same), and the joint spread of (position, index) over a grid."""
    n = len(order)
    position = np.empty(n, np.int64)
    position[order] = np.arange(n)
    displacement = (order - np.arange(n)) % n
    gaps = (np.diff(order) % n - 1) * n // (n - 1)  # [1, n) spread over [0, n)
    places = (np.diff(position) % n - 1) * n // (n - 1)
    grid = 16
    joint = np.bincount(np.arange(n) * grid // n * grid + order * grid // n, minlength=grid * grid)
    return {name: chi_square_p(np.bincount(values * BINS // n, minlength=BINS))
            for name, values in (("displacement", displacement), ("gaps", gaps), ("places", places))} | {
        "joint": chi_square_p(joint)}


@pytest.mark.parametrize("n", [100_003, 131_072])
def test_no_structure_that_a_chi_square_sees_and_randperm_hides(n):
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        reference = structure_p_values(torch.randperm(n, generator=generator).numpy())
        ours = structure_p_values(epoch_order(ShuffleSampler(Sized(n), seed=seed), seed))
        assert min(reference.values()) > ALPHA  # the test itself passes a true permutation
        assert min(ours.values()) > ALPHA, ours


def test_the_chi_square_tests_reject_a_structured_order():
    n = 100_003  # an affine map is a permutation, but every gap is the same
    assert structure_p_values((np.arange(n) * 7919 + 13) % n)["gaps"] < ALPHA
    local = np.arange(n).reshape(-1, 1)[: n // 7 * 7].reshape(-1, 7)[:, ::-1].ravel()  # shuffled runs of 7
    local = np.concatenate([local, np.arange(len(local), n)])
    assert structure_p_values(local)["joint"] < ALPHA


def randperm_block_order(n: int, block_size: int, window: int, seed: int, epoch: int) -> np.ndarray:
    """The block order before the keyed bijection: the blocks in a stored numpy permutation,
    each window's records shuffled by one generator (what class mixing is compared with)."""
    blocks = np.random.default_rng([seed, epoch]).permutation(math.ceil(n / block_size))
    rng, pieces = np.random.default_rng([seed, epoch, 0]), []
    for w in range(0, len(blocks), window):
        positions = np.concatenate([np.arange(b * block_size, min(b * block_size + block_size, n))
                                    for b in blocks[w:w + window]])
        rng.shuffle(positions)
        pieces.append(positions)
    return np.concatenate(pieces)


def test_block_order_mixes_classes_per_batch_as_the_stored_block_permutation_did():
    labels = np.repeat(np.arange(100), 130)  # class-sorted storage: 100 classes in runs of 130
    n, batch, epochs = len(labels), 64, 12
    for block_size, window in ((64, 16), (16, 4)):
        ours = [class_entropy(labels, epoch_order(BlockShuffleSampler(Sized(n), block_size, window, seed=1), e), batch)
                for e in range(epochs)]
        before = [class_entropy(labels, randperm_block_order(n, block_size, window, 1, e), batch)
                  for e in range(epochs)]
        # Not worse beyond 3 standard errors of the difference of the means (a one-sided z test
        # at about ALPHA): an epoch's figure varies with where the short last block falls.
        error = math.sqrt((np.var(ours, ddof=1) + np.var(before, ddof=1)) / epochs)
        assert np.mean(ours) >= np.mean(before) - 3 * error, (block_size, window, ours, before)


def traced_peak(run) -> int:
    """Peak bytes allocated (numpy's arrays included) while run() runs."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", [ShuffleSampler, BlockShuffleSampler])
def test_a_billion_records_cost_a_few_mb_to_start_or_resume_on_any_ranks(kind):
    n = 10 ** 9

    def first_indexes():
        sampler = kind(Sized(n), seed=2, rank=3, world_size=8)
        sampler.set_epoch(4)
        found = [int(index) for _, index in zip(range(10_000), sampler)]
        assert len(sampler) == n // 8 and len(set(found)) == 10_000
        elsewhere = kind(Sized(n), seed=2, rank=1, world_size=3)
        elsewhere.set_epoch(7)  # resumed 600M samples into epoch 4, on 3 ranks
        elsewhere.load_state_dict({**sampler.state_dict(), "position": 75_000_000})
        resumed = [int(index) for _, index in zip(range(10_000), elsewhere)]
        assert len(elsewhere) == -(-(n - 600_000_000) // 3) and len(set(resumed)) == 10_000

    assert traced_peak(first_indexes) < 4 << 20


def children() -> set[int]:
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(child) for child in f.read().split()}


def loader_memory(n: int, kind) -> tuple[float, list[float]]:
    """(this process's USS growth, each worker's USS) in MB once a 2-worker DataLoader over
    n items, this sampler dealing rank 1 of 4 its share, has handed out 10,240 indexes."""
    before, earlier = memory()["uss_mb"], children()  # an earlier loader's workers may still be exiting
    loader = tud.DataLoader(Sized(n), batch_size=256, num_workers=2,
                            sampler=kind(Sized(n), seed=1, rank=1, world_size=4))
    batches = iter(loader)
    seen = [next(batches) for _ in range(40)]
    assert len(set(torch.cat(seen).tolist())) == 10_240
    workers = [memory(child)["uss_mb"] for child in children() - earlier]
    grown = memory()["uss_mb"] - before
    del batches
    return grown, workers


@pytest.mark.parametrize("kind", [ShuffleSampler, BlockShuffleSampler])
def test_a_dataloader_over_a_billion_items_holds_what_one_over_100k_does(kind):
    loader_memory(100_000, kind)  # the DataLoader's own first-use costs, paid once
    small_main, small_workers = loader_memory(100_000, kind)
    # Of two runs the smaller growth: a busy machine's allocator now and then keeps a few MB more
    # of one run's freed batches, which a per-record cost (8 GB at 10^9) would dwarf.
    (large_main, large_workers), again = loader_memory(10 ** 9, kind), loader_memory(10 ** 9, kind)
    large_main = min(large_main, again[0])
    assert len(large_workers) == 2 and large_main < small_main + 4
    assert max(large_workers) < max(small_workers) + 4
