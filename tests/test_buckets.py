"""The bucket ladder's host-side helpers (no jax): pricing a recorded run's steps on a ladder."""

from __future__ import annotations

import pytest

from jaxcpp.core.buckets import padding_share


def test_padding_share_counts_padded_tokens_over_computed_ones():
    # 64 -> 64 (no padding), 40 -> 64 (24), 100 -> 128 (28): 52 of 256 computed tokens are padding.
    assert padding_share([64, 40, 100], [64, 128]) == pytest.approx(52 / 256)
    assert padding_share([64, 128], [64, 128]) == 0.0


def test_padding_share_rejects_what_it_cannot_price():
    with pytest.raises(ValueError, match="step_tokens"):
        padding_share([], [64])
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        padding_share([65], [64])
