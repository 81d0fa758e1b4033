"""readers.stats: wait and step times from a scripted clock, and the starvation warning."""
import warnings

import pytest
import torch

from readers import LoaderStats, LoaderWarning, make_loader


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def scripted(clock, waits, batch=4):
    """A loader whose next() takes waits[i] seconds of the clock."""
    class Loader:
        num_workers = 3

        def __len__(self):
            return len(waits)

        def __iter__(self):
            for wait in waits:
                clock.t += wait
                yield torch.zeros(batch, 1)
    return Loader()


def run(stats, clock, step):
    for _ in stats:
        clock.t += step


def test_waits_and_steps_are_measured():
    clock = Clock()
    stats = LoaderStats(scripted(clock, [0.5] + [0.01] * 20), clock=clock, warmup=1, window=100)
    run(stats, clock, 0.09)
    summary = stats.summary()
    assert summary["steps"] == 21 and summary["measured_steps"] == 20 and summary["samples"] == 80
    assert summary["wait_s"] == pytest.approx(0.2) and summary["step_s"] == pytest.approx(1.8)
    assert summary["wait_fraction"] == pytest.approx(0.1) and summary["samples_per_s"] == pytest.approx(40)
    assert len(stats) == 21 and stats.num_workers == 3


def test_a_starved_loop_is_warned_once_with_advice():
    clock = Clock()
    stats = LoaderStats(scripted(clock, [0.05] * 40), clock=clock, warmup=2, window=10, threshold=0.2)
    advice = r"waited for data 50% .*GPU is waiting for data.*more workers \(now 3\)"
    with pytest.warns(LoaderWarning, match=advice) as record:
        run(stats, clock, 0.05)
    assert len(record) == 1


def test_a_fed_loop_is_not_warned_and_warnings_restart_per_epoch():
    clock = Clock()
    stats = LoaderStats(scripted(clock, [0.001] * 30), clock=clock, warmup=0, window=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(stats, clock, 0.1)
        run(stats, clock, 0.1)
    assert stats.summary()["steps"] == 30  # figures are per epoch


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        LoaderStats([], threshold=5)
    with pytest.raises(ValueError, match="window"):
        LoaderStats([], window=0)


def test_make_loader_stats_option():
    data = [(torch.zeros(3, 2, 2, dtype=torch.uint8), 0)] * 8
    stats = make_loader(data, 2, workers=0, stats=True)
    assert isinstance(stats, LoaderStats) and sum(len(x) for x, _ in stats) == 8
    assert stats.summary()["steps"] == 4


def test_an_epoch_within_the_warm_up_says_why_it_measured_nothing():
    clock = Clock()
    stats = LoaderStats(scripted(clock, [0.1] * 3), clock=clock, warmup=5)
    run(stats, clock, 0.2)
    summary = stats.summary()
    assert summary["measured_steps"] == 0 and summary["wait_fraction"] == 0.0
    assert "nothing measured: this epoch ran 3 step(s), all within the first warmup=5" in summary["note"]
    assert "LoaderStats(loader, warmup=0)" in repr(stats)
    longer = LoaderStats(scripted(clock, [0.1] * 8), clock=clock, warmup=5)
    run(longer, clock, 0.3)
    assert "note" not in longer.summary() and longer.summary()["wait_fraction"] == pytest.approx(0.25)
