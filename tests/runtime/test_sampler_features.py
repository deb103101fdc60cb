"""The device sampler's penalties, min_p, min_tokens' ban, history and logprobs, against transformers'
logits processors where they define the same rule (repetition penalty, min-p) and against the rule
written out in numpy where they do not (OpenAI's presence and frequency penalties)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcpp.runtime import sampler
from jaxcpp.sampling_params import MAX_BANNED_IDS, MAX_LOGPROBS

V, W = 64, 4
rng = np.random.default_rng(3)
LOGITS = rng.normal(0, 3, (W, V)).astype(np.float32)
HISTORY = [[1, 5, 5, 9], [], [2, 2, 2], [63]]   # generated tokens per row
PROMPTS = [[3, 5], [7], [], [0, 1]]


def counts_and_prompt() -> tuple[np.ndarray, np.ndarray]:
    counts, in_prompt = np.zeros((W, V), np.int32), np.zeros((W, V), bool)
    for r in range(W):
        np.add.at(counts[r], HISTORY[r], 1)
        in_prompt[r, PROMPTS[r]] = True
    return counts, in_prompt


def test_repetition_penalty_is_transformers_rule_on_prompt_and_generated_tokens() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    counts, in_prompt = counts_and_prompt()
    ones, zeros = jnp.ones(W), jnp.zeros(W)
    ours = sampler.apply_penalties(jnp.asarray(LOGITS), jnp.asarray(counts), jnp.asarray(in_prompt), zeros, zeros,
                                   1.7 * ones)
    for r in range(W):  # transformers' input_ids are the prompt and the generated tokens
        ids = torch.tensor([PROMPTS[r] + HISTORY[r]])
        theirs = transformers.RepetitionPenaltyLogitsProcessor(1.7)(ids, torch.tensor(LOGITS[r:r + 1]))
        np.testing.assert_allclose(np.asarray(ours[r]), theirs.numpy()[0], rtol=1e-6)


def test_presence_and_frequency_penalties_are_openais_rule_on_generated_tokens_only() -> None:
    counts, in_prompt = counts_and_prompt()
    presence, frequency = np.array([0.5, 1.0, -0.3, 2.0], np.float32), np.array([0.2, 0.0, 1.5, -1.0], np.float32)
    ours = sampler.apply_penalties(jnp.asarray(LOGITS), jnp.asarray(counts), jnp.asarray(in_prompt),
                                   jnp.asarray(presence), jnp.asarray(frequency), jnp.ones(W))
    expected = LOGITS - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-6)


def test_min_p_keeps_what_transformers_keeps() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for min_p in (0.05, 0.2, 0.9):
        ours = np.asarray(sampler._mask_min_p(jnp.asarray(LOGITS), jnp.full(W, min_p)))
        theirs = transformers.MinPLogitsWarper(min_p)(None, torch.tensor(LOGITS)).numpy()
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
    assert bool(jnp.all(sampler._mask_min_p(jnp.asarray(LOGITS), jnp.zeros(W)) == LOGITS))  # 0: a no-op


def step_input(**over: object) -> sampler.SamplingInput:
    t = 8
    fields = dict(logits=jnp.asarray(LOGITS), temperature=jnp.zeros(W), top_k=jnp.zeros(W, jnp.int32),
                  top_p=jnp.ones(W), seeds=jnp.zeros(W, jnp.uint32), num_generated=jnp.zeros(W, jnp.int32),
                  min_p=jnp.zeros(W), presence_penalty=jnp.zeros(W), frequency_penalty=jnp.zeros(W),
                  repetition_penalty=jnp.ones(W), history_slot=jnp.full(W, -1, jnp.int32),
                  clear_slot=jnp.full(W, -1, jnp.int32), banned_ids=jnp.full((W, MAX_BANNED_IDS), -1, jnp.int32),
                  wants_logprobs=jnp.ones(W, jnp.int32),
                  token_ids=jnp.zeros(t, jnp.int32), prompt_slot=jnp.full(t, -1, jnp.int32))
    fields.update({k: jnp.asarray(v) for k, v in over.items()})
    return sampler.SamplingInput(**fields)  # type: ignore[arg-type]


def test_banned_ids_cannot_be_drawn_and_logprobs_are_of_the_raw_logits() -> None:
    greedy = LOGITS.argmax(-1)
    banned = np.full((W, MAX_BANNED_IDS), -1, np.int32)
    banned[0, :2] = [greedy[0], 11]
    out, _ = jax.jit(sampler.sample_step)(step_input(banned_ids=banned), sampler.empty_history(2, V))
    masked = LOGITS[0].copy()
    masked[[greedy[0], 11]] = -np.inf
    assert int(out.tokens[0]) == int(masked.argmax()) and list(out.tokens[1:]) == list(greedy[1:])
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(LOGITS)))
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[np.arange(W), np.asarray(out.tokens)], atol=1e-6)
    top = np.argsort(-raw, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids), top)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(raw, top, -1), atol=1e-6)


def test_the_history_gathers_prompt_tokens_counts_draws_and_is_cleared_for_a_new_request() -> None:
    step = jax.jit(sampler.sample_step)
    history = sampler.empty_history(2, V)
    tokens = np.array([4, 4, 9, 0, 0, 0, 0, 0], np.int32)
    slots = np.array([1, 1, 1, -1, -1, -1, -1, -1], np.int32)
    first = step_input(token_ids=tokens, prompt_slot=slots, clear_slot=np.array([1, -1, -1, -1], np.int32),
                       history_slot=np.array([1, -1, -1, -1], np.int32), repetition_penalty=np.full(W, 2.0))
    out, history = step(first, history)
    assert set(np.flatnonzero(np.asarray(history.in_prompt[1]))) == {4, 9}
    assert np.asarray(history.counts[1]).tolist() == np.eye(V, dtype=int)[int(out.tokens[0])].tolist()
    assert not np.asarray(history.in_prompt[0]).any() and not np.asarray(history.counts[0]).any()
    cleared, history = step(step_input(clear_slot=np.array([1, -1, -1, -1], np.int32)), history)
    assert not np.asarray(history.in_prompt).any() and not np.asarray(history.counts).any()


def test_the_cpu_path_skips_only_what_no_row_asks_for(monkeypatch) -> None:
    """On CPU the logprobs run under lax.cond; elsewhere always: same results. Without a history (None)
    the rows without one draw what they draw with it."""
    banned = np.full((W, MAX_BANNED_IDS), -1, np.int32)
    banned[2, 0] = int(LOGITS[2].argmax())
    x = step_input(history_slot=np.array([0, -1, 1, -1], np.int32), repetition_penalty=np.full(W, 1.5),
                   banned_ids=banned, wants_logprobs=np.array([1, 0, 0, 1], np.int32),
                   token_ids=np.array([3, 5, 0, 0, 0, 0, 0, 0], np.int32),
                   prompt_slot=np.array([0, 1, -1, -1, -1, -1, -1, -1], np.int32))
    cpu = jax.jit(sampler.sample_step)(x, sampler.empty_history(2, V))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # traced anew, unconditional
    other = jax.jit(sampler.sample_step)(x, sampler.empty_history(2, V))
    for a, b in zip(jax.tree_util.tree_leaves(cpu), jax.tree_util.tree_leaves(other), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plain, none = jax.jit(sampler.sample_step)(x._replace(history_slot=jnp.full(W, -1, jnp.int32)), None)
    assert none is None
    np.testing.assert_array_equal(np.asarray(plain.tokens)[[1, 3]], np.asarray(cpu[0].tokens)[[1, 3]])
    nothing = step_input(wants_logprobs=np.zeros(W, np.int32))
    out, _ = jax.jit(sampler.sample_step)(nothing, None)
    assert list(np.asarray(out.tokens)) == list(LOGITS.argmax(-1))


@pytest.mark.parametrize("rows", [1, 2])
def test_the_first_rows_alone_draw_what_they_draw_among_all_rows(rows) -> None:
    """`rows` (the plain program on the step's rows alone): the same tokens and logprobs for those rows,
    greedy, drawn, truncated; the rows past them are padding."""
    x = step_input(temperature=np.array([0.9, 0.0, 1.0, 0.7], np.float32), top_k=np.array([0, 0, 5, 0], np.int32),
                   top_p=np.array([1.0, 1.0, 1.0, 0.8], np.float32), seeds=np.arange(W, dtype=np.uint32) + 3,
                   num_generated=np.array([2, 0, 7, 1], np.int32), min_p=np.array([0.0, 0.0, 0.0, 0.1], np.float32))
    for first in (x, x._replace(top_k=x.top_k.at[0].set(3))):  # rows that truncate (sorts) or not
        every, _ = jax.jit(sampler.sample_step)(first, None)
        alone, none = jax.jit(sampler.sample_step, static_argnames="rows")(first, None, rows=rows)
        assert none is None
        for a, b in zip(alone, every, strict=True):
            assert a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a)[:rows], np.asarray(b)[:rows])
