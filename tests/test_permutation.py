"""readers.permutation: a keyed bijection on [0, n), checked exhaustively on small n."""
import numpy as np
import pytest

from readers.permutation import KeyedPermutation


@pytest.mark.parametrize("key", [(0, 0), (7, 3), (-1, 2 ** 40)])
def test_every_small_n_is_a_bijection_and_inverts(key):
    for n in [*range(0, 130), 1000, 4097, 65536]:
        perm = KeyedPermutation(n, key)
        out = perm(np.arange(n))
        assert np.array_equal(np.sort(out), np.arange(n)), n
        assert np.array_equal(perm.inverse(out), np.arange(n)), n


def test_keys_give_unrelated_orders():
    orders = [KeyedPermutation(10_000, (0, epoch))(np.arange(10_000)) for epoch in range(3)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert (orders[a] == orders[b]).sum() < 10  # a random pair shares ~1 fixed place


def test_a_billion_positions_cost_only_what_is_asked():
    perm = KeyedPermutation(10 ** 9, (0, 0))
    head = perm(np.arange(4096))
    assert len(set(head.tolist())) == 4096 and head.min() >= 0 and head.max() < 10 ** 9
    assert np.array_equal(perm.inverse(head), np.arange(4096))


def test_positions_outside_are_refused():
    with pytest.raises(IndexError):
        KeyedPermutation(10, (0,))(np.array([10]))
    with pytest.raises(ValueError):
        KeyedPermutation(-1, (0,))
