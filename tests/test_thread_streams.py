"""Streams under thread workers (readers.thread_streams): a WDSDataset read with
worker_kind="threads" gives the batches of as many worker processes in their order, pass
after pass, as tensors in the ring; a state saved with processes mid-epoch resumes with
threads and back; a failing stream surfaces in the trainer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import readers
from readers import make_loader

from conftest import packed_three_ways, sample_ids

BATCH, SEED, WORKERS = 3, 5, 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return Path(packed_three_ways(tmp_path_factory.mktemp("streams"))) / "d.wds"


def stream_loader(shards: Path, kind: str, **options):
    return make_loader(readers.WDSDataset(shards, decode="raw", shuffle=16, seed=SEED), BATCH, workers=WORKERS,
                       seed=SEED, collate_fn=sample_ids, worker_kind=kind, **options)


def test_a_stream_read_by_threads_gives_the_batches_of_worker_processes_pass_after_pass(shards):
    processes, threads = stream_loader(shards, "processes"), stream_loader(shards, "threads")
    for _ in range(2):
        expected = list(processes)
        assert expected and list(threads) == expected
    assert len(threads) == len(processes)


def test_a_streams_tensor_batches_are_views_of_the_ring(shards):
    made = make_loader(readers.WDSDataset(shards, decode="numpy"), BATCH, workers=WORKERS, train=False,
                       worker_kind="threads")
    want = list(make_loader(readers.WDSDataset(shards, decode="numpy"), BATCH, workers=WORKERS, train=False))
    got = []
    for images, labels in made:
        assert made.background().ring.holds(images)
        got.append((images.clone(), labels))
    assert len(got) == len(want)
    for (images, labels), (want_images, want_labels) in zip(got, want):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


@pytest.mark.parametrize("saved,resumed", [("processes", "threads"), ("threads", "processes")])
def test_a_stream_state_saved_with_one_kind_resumes_with_the_other(shards, saved, resumed):
    whole = stream_loader(shards, "processes")
    epochs = [list(whole), list(whole)]
    made = stream_loader(shards, saved)
    assert list(made) == epochs[0]
    batches = iter(made)
    head = [next(batches) for _ in range(2)]
    state = made.state_dict()
    del batches
    again = stream_loader(shards, resumed)
    again.load_state_dict(state)
    assert head + list(again) == epochs[1]


class Broken(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ((torch.zeros(2), i) for i in range(4))
        raise OSError("shard 3 is truncated")


def test_a_failing_stream_surfaces_in_the_trainer():
    made = make_loader(Broken(), 2, workers=1, train=False, worker_kind="threads")
    with pytest.raises(RuntimeError, match="thread worker 0 of 1: the stream's batch 2 failed: OSError: shard 3 is"):
        list(made)
