"""The bucket ladder's host-side helpers (no jax): pricing a recorded run's steps on a ladder."""

from __future__ import annotations

import pytest

from jaxcpp.core.buckets import padding_share, sampler_programs, sampler_row_rungs, sampler_rows


def test_padding_share_counts_padded_tokens_over_computed_ones():
    # 64 -> 64 (no padding), 40 -> 64 (24), 100 -> 128 (28): 52 of 256 computed tokens are padding.
    assert padding_share([64, 40, 100], [64, 128]) == pytest.approx(52 / 256)
    assert padding_share([64, 128], [64, 128]) == 0.0


def test_padding_share_rejects_what_it_cannot_price():
    with pytest.raises(ValueError, match="step_tokens"):
        padding_share([], [64])
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        padding_share([65], [64])


def test_the_plain_sampler_draws_the_steps_rows_rounded_up_to_a_power_of_two():
    assert sampler_row_rungs(64) == [1, 2, 4, 8, 16, 32, 64]
    assert sampler_row_rungs(48) == [1, 2, 4, 8, 16, 32, 48] and sampler_row_rungs(1) == [1]
    assert [sampler_rows(n, 64) for n in (0, 1, 2, 3, 5, 16, 17, 64)] == [1, 1, 2, 4, 8, 16, 32, 64]
    assert sampler_rows(40, 48) == 48 and sampler_rows(None, 64) == 64  # None: a step that did not say
    programs = sampler_programs(8)  # with a history or a mask: every row; the plain one: each rung
    assert sorted(programs) == sorted([(True, False, 8), (False, True, 8), (True, True, 8),
                                       (False, False, 1), (False, False, 2), (False, False, 4), (False, False, 8)])
