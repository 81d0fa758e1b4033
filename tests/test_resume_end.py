"""A torchdata StatefulDataLoader state saved once the loop over an epoch has ended (a resume
that silently repeated that epoch): loaded into a new loader, with 0 or 2 DataLoader workers,
on the ranks that saved it or on another number, the next pass is exactly a fresh run's next
epoch, whether the loop's set_epoch comes before or after the load; a run that never calls
set_epoch goes on as it would have without the stop (docs/resume.md).

torchdata hands the saved states over as the next pass begins, after the loop's set_epoch,
finds the restored pass finished and starts another at once: the samplers and the stream must
leave that one the epoch set, not the saved one.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from conftest import packed_three_ways  # noqa: E402
from test_elastic import epoch_of, flat  # noqa: E402
from test_stateful_workers import CASES, stateful  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

EPOCH = 1  # the epoch run to its end before the state is saved; the run resumes at EPOCH + 1


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> str:
    return packed_three_ways(tmp_path_factory.mktemp("end"))


@pytest.mark.parametrize("workers", (0, 2))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("saving_world, drop_last", [(2, False), (3, True)])  # 3 ranks: a partial batch dropped
def test_a_state_saved_after_the_loop_resumes_at_the_next_epoch_on_any_world(packs, case, workers, saving_world,
                                                                            drop_last):
    def loader(rank: int, world_size: int):
        return stateful(packs, case, workers, rank, world_size, drop_last=drop_last)

    saving, ordered = loader(0, saving_world)
    saved = epoch_of(saving, ordered, EPOCH)  # the loop over the epoch, run to its end
    state = json.loads(json.dumps(saving.state_dict()))
    for world_size in (2, 3):
        for rank in range(world_size):  # rank 0's state resumes every rank
            where = f"{case} with {workers} workers, rank {rank} of {world_size} from {saving_world}"
            fresh, fresh_ordered = loader(rank, world_size)
            expected = epoch_of(fresh, fresh_ordered, EPOCH + 1)
            assert flat(expected), where
            if (rank, world_size) == (0, saving_world):
                assert expected != saved, "the next epoch is another order"
            after, ordered = loader(rank, world_size)
            after.load_state_dict(state)
            assert epoch_of(after, ordered, EPOCH + 1) == expected, f"{where}: set_epoch after the load"
            before, ordered = loader(rank, world_size)
            ordered.set_epoch(EPOCH + 1)
            before.load_state_dict(state)
            assert list(before) == expected, f"{where}: set_epoch before the load"
            assert epoch_of(before, ordered, EPOCH + 2) == epoch_of(fresh, fresh_ordered, EPOCH + 2), where


@pytest.mark.parametrize("workers", (0, 2))
@pytest.mark.parametrize("case", CASES)
def test_a_run_that_never_sets_the_epoch_goes_on_as_without_the_stop(packs, case, workers):
    plain, _ = stateful(packs, case, workers, 0, 3, drop_last=True)
    list(plain)
    resumed, _ = stateful(packs, case, workers, 0, 3, drop_last=True)
    resumed.load_state_dict(plain.state_dict())
    assert list(resumed) == list(plain)  # the pass the uninterrupted run makes next: the epoch it is at
