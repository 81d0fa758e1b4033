"""How a WebDataset split is cut into shards by default: the auto size and the balanced count.

shard_size None (the default) is "auto", a balanced split: the shards hold the same number
of samples to within one, so ranks that take whole shards get equal shares and pad
little. Their number is the split's expected bytes (the mean sample so far, tar headers
included, times the sample count pack() passes to begin_split) over the auto size
(AUTO_SHARDS shards, each within [MIN_AUTO_SHARD_SIZE, MAX_AUTO_SHARD_SIZE]: enough
for several ranks x DataLoader workers once a split is large enough, none tiny nor
huge), rounded up to a multiple of one of SHARD_MULTIPLES, the first that keeps shards
of MIN_BALANCED_SHARD_SIZE or more: of 12, so that 2, 3, 4, 6 or 12 ranks divide it,
else of 6, else of 2; a split too small for any keeps the count the size gives; at most
one shard per sample. The count is fixed after PLAN_SAMPLES samples or when the first
shard closes; a split that comes out smaller than expected (skipped files) has a
smaller last shard or fewer shards, and no shard grows past MAX_AUTO_SHARD_SIZE. A
max_count, or a shard_size, set by the user cuts shards by it instead (auto bytes
beside a max_count).
"""
from __future__ import annotations

import math

from ..cores import available_cores

AUTO_SHARDS = 64
SHARD_MULTIPLES = (12, 6, 2)  # what auto shard counts are rounded up to: rank counts that divide them
MIN_BALANCED_SHARD_SIZE = 1_000_000  # rounding up the count stops short of shards smaller than this
PLAN_SAMPLES = 16  # a balanced split's shard count is fixed by then (or when its first shard closes)
MIN_AUTO_SHARD_SIZE = 4_000_000
MAX_AUTO_SHARD_SIZE = 1_000_000_000


def auto_shard_size(mean_sample_bytes: float, expected_count: int) -> int:
    """The shard size that splits expected_count samples into AUTO_SHARDS shards, bounded."""
    wanted = int(mean_sample_bytes * expected_count / AUTO_SHARDS)
    return min(MAX_AUTO_SHARD_SIZE, max(MIN_AUTO_SHARD_SIZE, wanted))


def balanced_shard_count(mean_sample_bytes: float, expected_count: int) -> int:
    """How many shards a balanced split of expected_count samples makes (module docstring)."""
    total = mean_sample_bytes * expected_count
    count = max(1, math.ceil(total / auto_shard_size(mean_sample_bytes, expected_count)))
    rounded = (-(-count // m) * m for m in SHARD_MULTIPLES)
    count = next((r for r in rounded if total / r >= MIN_BALANCED_SHARD_SIZE), count)
    return max(1, min(count, expected_count))


class BalancedCut:
    """Where a balanced split of expected_count samples cuts its shards, as they come."""

    def __init__(self, expected_count: int):
        self.expected = expected_count
        self.planned: int | None = None  # the shard count, once fixed

    def shards(self, added: int, split_bytes: int) -> int:
        """The shard count: fixed, or estimated from the mean sample so far (split_bytes
        holds the next sample's, which makes added + 1)."""
        if self.planned is not None:
            return self.planned
        return balanced_shard_count(split_bytes / (added + 1), self.expected)

    def full(self, closed: int, added: int, in_shard: int, split_bytes: int) -> bool:
        """Whether the current shard (after `closed` shards, holding in_shard of the added
        samples) is full: it holds the samples not yet in a closed shard over the shards
        left, rounded up, so shards differ by one at most."""
        shards, left = self.shards(added, split_bytes), self.expected - (added - in_shard)
        if closed >= shards or left <= 0:  # more samples than expected cannot come; never cut there
            return False
        return in_shard >= -(-left // (shards - closed))

    def note(self, added: int, split_bytes: int, cutting: bool) -> None:
        """Fix the count once PLAN_SAMPLES samples came, or at the first cut."""
        if self.planned is None and (cutting or added + 1 >= PLAN_SAMPLES):
            self.planned = self.shards(added, split_bytes)


def few_shards_warning(split: str, shards: int, count: int) -> str | None:
    """The warning for a split of count samples in fewer shards than this machine's cores,
    though it could have more: streaming readers then share shards between DataLoader
    workers, and a worker whose run starts inside a shard streams past the samples before
    it (remote, or parsed)."""
    cores = available_cores()
    if shards >= cores or count <= shards:
        return None
    return (f"split {split}: {shards} shard(s) for {count} samples, fewer than this machine's {cores} cores; "
            "streaming readers then share shards between DataLoader workers, which from object storage read past "
            f"each other's samples: re-pack with a smaller --shard-size or --max-count {max(1, count // cores)} "
            f"for {cores} or more shards")
