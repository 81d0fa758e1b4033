"""A keyed random permutation of [0, n) that computes its i-th element on demand.

The stateless order everything else builds on (the samplers, mixtures): an epoch's
order is the bijection keyed by (seed, epoch, ...), evaluated at the positions a rank
reads, a batch or a window at a time, so no array of n is ever built and any position
is O(1) to reach, which is what makes a resume cost nothing and the order the same on
any number of ranks and workers.

The bijection is a balanced Feistel network on the smallest even number of bits that
covers n, with cycle walking: a value that lands at or past n goes through the network
again until it lands inside, which keeps the map a bijection on [0, n) (the network is
one on [0, 2^bits), and 2^bits < 4n, so a position walks about twice on average). The
round function is SplitMix64's finaliser of (half, round key); eight rounds, where four
already make a Feistel network a pseudorandom permutation (Luby-Rackoff), so no
structure is left to see. Grain's index_shuffle is the same idea. Where a half is at most
TABLE_BITS wide (n up to 2^24), the round function is tabled once per permutation at
every half value (about 2 sqrt(n) entries a round), and each round looks it up.
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np

ROUNDS = 8
# Halves at most this wide take each round from a table of the round function at every half
# value (8 x 2^12 entries, 256 KB at most, for n up to 2^24): a round is then one lookup
# instead of eleven numpy passes, what an epoch of a small dataset spent most of its order on.
TABLE_BITS = 12
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def round_keys(key: tuple[int, ...], rounds: int = ROUNDS) -> np.ndarray:
    """`rounds` 64-bit keys derived from a tuple of ints (seed, epoch, ...): any change to
    any part of the key gives unrelated keys."""
    parts = []
    for part in key:
        if isinstance(part, bool) or not isinstance(part, (int, np.integer)):
            raise TypeError(f"permutation key parts must be ints, got {part!r}")
        parts.append(int(part).to_bytes(16, "little", signed=True))  # any int a seed or epoch can be
    digest = hashlib.blake2b(b"".join(parts), digest_size=8 * rounds, person=b"packer-perm").digest()
    return np.array(struct.unpack(f"<{rounds}Q", digest), dtype=np.uint64)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """SplitMix64's finaliser of values ^ key: every input bit moves every output bit."""
    z = values ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class KeyedPermutation:
    """A bijection on [0, n), fixed by `key` (a tuple of ints): perm(positions) gives the
    elements of the permutation at those positions, perm.inverse(values) the positions of
    those values. Nothing of size n is held."""

    def __init__(self, n: int, key: tuple[int, ...]):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0 or n > 2 ** 62:
            raise ValueError(f"KeyedPermutation: n must be an int in [0, 2^62], got {n!r}")
        self.n, self.key = int(n), tuple(int(k) for k in key)
        self.half = max(1, ((self.n - 1).bit_length() + 1) // 2) if self.n > 1 else 1
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = round_keys(self.key)
        self._table: np.ndarray | None = None  # round_table's, made on first use

    def round_table(self) -> np.ndarray | None:
        """Each round's function at every half value, (ROUNDS, 2^half), or None for halves
        wider than TABLE_BITS."""
        if self._table is None and self.half <= TABLE_BITS:
            table = _mix(np.arange(1 << self.half, dtype=np.uint64)[None, :], self.keys[:, None]) & self.mask
            self._table = table.astype(np.intp)  # values below 2^TABLE_BITS
        return self._table

    def _round(self, r: int, half: np.ndarray) -> np.ndarray:
        """Round r's function of these half values (halves wider than TABLE_BITS: no table)."""
        return _mix(half, self.keys[r]) & self.mask

    def _network(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = values >> shift, values & self.mask
        table = self.round_table()
        if table is not None:  # halves are table positions: intp, so each lookup casts nothing
            left, right = left.astype(np.intp), right.astype(np.intp)
            for row in table:
                left, right = right, left ^ row.take(right)
            return (left.astype(np.uint64) << shift) | right.astype(np.uint64)
        for r in range(len(self.keys)):
            left, right = right, left ^ self._round(r, right)
        return (left << shift) | right

    def _unnetwork(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = values >> shift, values & self.mask
        table = self.round_table()
        if table is not None:
            left, right = left.astype(np.intp), right.astype(np.intp)
            for row in table[::-1]:
                left, right = right ^ row.take(left), left
            return (left.astype(np.uint64) << shift) | right.astype(np.uint64)
        for r in reversed(range(len(self.keys))):
            left, right = right ^ self._round(r, left), left
        return (left << shift) | right

    def _walk(self, positions, step) -> np.ndarray:
        values = np.asarray(positions, dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() >= self.n):
            raise IndexError(f"KeyedPermutation: positions must lie in [0, {self.n})")
        if self.n <= 1:
            return values.copy()
        out = step(values.astype(np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.n))
        while outside.size:  # cycle walking: each outside value goes round again
            out[outside] = step(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64)

    def __call__(self, positions) -> np.ndarray:
        """The permutation's elements at `positions` (an int array, each in [0, n))."""
        return self._walk(positions, self._network)

    def inverse(self, values) -> np.ndarray:
        """The positions at which `values` stand in the permutation."""
        return self._walk(values, self._unnetwork)

    def __len__(self) -> int:
        return self.n
