"""The stateless sample order (version 2, every run's): a seeded bijection of [0, N) computed per
index, so a rank's order holds a few keys whatever the number of sequences."""

from __future__ import annotations

import numpy as np
import pytest

from trinity_train.data.mixing import FeistelPermutation, StatelessOrder


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 65_537])
def test_the_feistel_permutation_is_a_seeded_bijection(n):
    perm = FeistelPermutation(n, [1234, 0])
    image = perm(np.arange(n))
    assert np.array_equal(np.sort(image), np.arange(n))  # every index once, none outside [0, n)
    assert np.array_equal(FeistelPermutation(n, [1234, 0])(np.arange(n)), image)  # the seed decides
    assert np.array_equal(perm(np.arange(n)[::-1])[::-1], image)  # per index, whatever comes with it
    if n >= 64:
        assert not np.array_equal(FeistelPermutation(n, [1235, 0])(np.arange(n)), image)
        assert not np.array_equal(image, np.arange(n))
    with pytest.raises(IndexError):
        perm(np.array([n]))


def test_a_stateless_order_holds_a_few_keys_at_any_size_and_a_fresh_permutation_each_epoch():
    n = 1000
    order = StatelessOrder(n, seed=7, source=2)
    samples = order.sequences(np.arange(3 * n))
    epochs = samples.reshape(3, n)
    for epoch in epochs:  # no sequence repeats before every other was seen
        assert np.array_equal(np.sort(epoch), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(StatelessOrder(n, seed=7, source=3).sequences(np.arange(n)), epochs[0])

    huge = StatelessOrder(3_700_000_000, seed=7, source=0)  # 15T tokens of 4,096 in one source
    picked = huge.sequences(np.array([0, 1, 3_699_999_999, 3_700_000_000, 10**12]))
    assert ((picked >= 0) & (picked < 3_700_000_000)).all()
    held = [a.nbytes for perm in huge._perms.values() for a in vars(perm).values() if isinstance(a, np.ndarray)]
    assert len(huge._perms) == 3 and sum(held) <= 3 * 64  # three epochs touched: six round keys each
