"""Token sampling on the device: penalties, min_tokens, greedy, temperature, min-p, top-k, top-p, per-request
seeds, and the log-probabilities clients ask for. The full logits never leave the device.

One step's sampling (`sample_step`), for each of the W rows the last stage hands over:

    history tables   clear the rows' slots that start a request, add the step's prompt tokens  (*)
    penalties        repetition (prompt + generated tokens), frequency and presence (generated tokens)  (*)
    min_tokens       the request's stop ids banned (-inf) until it has generated enough tokens  (*)
    grammar mask     tokens a constrained row's grammar forbids (its bitmask bit clear) -> -inf
                     (only in the programs for steps with a constrained row; the host picks them)
    draw             `sample`: greedy, or temperature -> min_p -> top_k -> top_p -> a seeded draw
    logprobs         log-softmax of the model's raw logits: the drawn token's, and the top MAX_LOGPROBS
                     (zeros when no row asks: on CPU they are not computed then)
    history tables   the drawn token counted for its request  (*)

(*) only in the program for steps where some row has a history or a ban; the host picks the program.

Penalties need each request's history, which the host cannot send every step (W x vocab counts), nor
know in time (async scheduling feeds tokens back on the device). So the last stage keeps it: `History`,
a table row (a slot) per request with penalties, kept by the host (`jaxcpp.core.scheduler`). The prompt's
tokens are added as its chunks pass; the draw adds each sampled token. Rows without a slot (-1) read an
empty history, for which every penalty is an exact no-op.

Each row draws with the key fold_in(PRNGKey(seed), step), where `step` is how many tokens the request
has generated: the same seed gives the same tokens whatever batch the request shares, and a request
preempted and recomputed draws the same tokens again.

On the CPU backend the sorts of top-k / top-p and the per-row threefry draw cost several times the
rest of a small model's decode step, so there a batch runs only what its rows ask for (`lax.cond`,
data, not shape: still one program): all-greedy batches take the argmax alone, and the sorts run only
when some sampling row sets top-k or top-p. Elsewhere every batch runs all of it: a GPU conditional
copies its predicate to the host and waits for it, a host sync per step that would undo async
scheduling. Either way a row's token is the same: the masks are exact no-ops on rows that do not ask
for them (top_k 0, top_p 1, min_p 0, no history, no ban), so a row never depends on the rows beside
it (no history, no ban: exact no-ops too). The logprobs are skipped on CPU the same way (`_when`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcpp.sampling_params import MAX_LOGPROBS


class History(NamedTuple):
    """Per-slot token history of the requests with penalties (device state of the last stage)."""

    counts: jax.Array     # [num_slots, V] int32: times each token was generated
    in_prompt: jax.Array  # [num_slots, V] bool: the token is in the prompt


class SamplingInput(NamedTuple):
    """What the last stage's bucket program hands the sampler: W rows (and the step's tokens, padded)."""

    logits: jax.Array              # [W, V] float32
    temperature: jax.Array         # [W] float32, 0 = greedy
    top_k: jax.Array               # [W] int32, 0 = off
    top_p: jax.Array               # [W] float32 in (0, 1]
    seeds: jax.Array               # [W] uint32
    num_generated: jax.Array       # [W] int32: tokens generated so far
    min_p: jax.Array               # [W] float32, 0 = off
    presence_penalty: jax.Array    # [W] float32
    frequency_penalty: jax.Array   # [W] float32
    repetition_penalty: jax.Array  # [W] float32, 1 = off
    history_slot: jax.Array        # [W] int32: the row's history slot, -1 = none
    clear_slot: jax.Array          # [W] int32: a slot to empty before this step's prompt tokens, -1 = none
    banned_ids: jax.Array          # [W, MAX_BANNED_IDS] int32: ids that may not be drawn, -1 = none
    wants_logprobs: jax.Array      # [W] int32: 1 for a row whose request asks for logprobs
    token_ids: jax.Array           # [Tmax] int32: the step's tokens
    prompt_slot: jax.Array         # [Tmax] int32: the slot a prompt token joins, -1 = none


class SampledTokens(NamedTuple):
    tokens: jax.Array        # [W] int32
    logprobs: jax.Array      # [W] float32: log-probability of the drawn token under the raw logits
    top_ids: jax.Array       # [W, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [W, MAX_LOGPROBS] float32


def empty_history(num_slots: int, vocab_size: int) -> History:
    return History(jnp.zeros((num_slots, vocab_size), jnp.int32), jnp.zeros((num_slots, vocab_size), bool))


def sample_step(x: SamplingInput, history: History | None, bitmask: jax.Array | None = None,
                rows: int | None = None) -> tuple[SampledTokens, History | None]:
    """One step's sampling. `history` None: no row of the step has a history or a ban, and this program
    (a second one, traced for None) does neither: the host picks it from the step's own data
    (`StepInput.needs_full_sampler`), so a step without penalties or min_tokens pays nothing for them, on
    any backend and without a device conditional. `bitmask` ([W, ceil(V / 32)] int32): each row's
    allowed tokens (structured outputs, `apply_bitmask`), data whatever the grammar; None (a step with
    no constrained row) traces the programs without it, which the host picks the same way. `rows`
    (static: a program each): sample only the first `rows` of the W rows (`_first_rows`)."""
    if rows is not None and rows < x.logits.shape[0]:
        return _first_rows(x, history, bitmask, rows)
    logits = x.logits
    if history is not None:
        history = _add_prompt_tokens(history, x)
        logits = apply_penalties(logits, *_rows_history(history, x.history_slot), x.presence_penalty,
                                 x.frequency_penalty, x.repetition_penalty)
        logits = _ban(logits, x.banned_ids)
    if bitmask is not None:  # a step with a constrained row: the programs traced with a mask
        logits = apply_bitmask(logits, bitmask)
    tokens = sample(logits, x.temperature, x.top_k, x.top_p, x.seeds, x.num_generated, x.min_p)
    rows = x.logits.shape[0]
    no_logprobs = (jnp.zeros(rows), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32), jnp.zeros((rows, MAX_LOGPROBS)))
    token_lp, top_ids, top_lp = _when(jnp.any(x.wants_logprobs > 0), lambda _: logprobs_of(x.logits, tokens),
                                      no_logprobs)
    if history is not None:
        counted = _slot_index(x.history_slot, history.counts.shape[0])
        history = history._replace(counts=history.counts.at[counted, tokens].add(1, mode="drop"))
    return SampledTokens(tokens, token_lp, top_ids, top_lp), history


def _first_rows(x: SamplingInput, history: History | None, bitmask: jax.Array | None,
                rows: int) -> tuple[SampledTokens, History | None]:
    """`sample_step` on the first `rows` rows, its outputs padded back to W rows (the rows past them are
    padding no one reads). Each row's token and logprobs are the same as in all W (a row never depends
    on the rows beside it), at a cost that follows the step's sequences, not W: on CPU a draw's noise,
    a vocabulary of threefry numbers a row, cost a lone stream among 64 rows several milliseconds a
    token (docs/benchmarks.md, "A lone stream"). The host picks `rows`: `jaxcpp.core.buckets.sampler_rows`."""
    width = x.logits.shape[0]
    first = SamplingInput(*(a if name in ("token_ids", "prompt_slot") else a[:rows]  # those are per token
                            for name, a in zip(x._fields, x, strict=True)))
    sampled, history = sample_step(first, history, None if bitmask is None else bitmask[:rows])
    return SampledTokens(*(jnp.pad(a, [(0, width - rows)] + [(0, 0)] * (a.ndim - 1)) for a in sampled)), history


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear may not be drawn: bit t % 32 of word t // 32 of a row ([W, words] int32,
    the grammar library's layout). Only the V logits' bits are read: words may run past V (padding bits,
    cropped here). An all-ones row (a free request) is an exact no-op."""
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [W, words, 32]: no gather
    allowed = bits.reshape(rows, -1)[:, :vocab] == 1
    return jnp.where(allowed, logits, -jnp.inf)


def _when(pred: jax.Array, fn: Any, operand: Any) -> Any:
    """`fn(operand)` where some row asks for it. On CPU only when `pred` holds (`lax.cond`: the logprobs
    cost nothing when no row asks); elsewhere always, since a device conditional syncs the host (module
    docstring). Either way a row's result is the same."""
    if jax.default_backend() != "cpu":
        return fn(operand)
    return lax.cond(pred, fn, lambda o: o, operand)


def logprobs_of(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-softmax of `logits` ([N, V]): each row's `tokens` entry ([N]; -1: anything) and its top MAX_LOGPROBS."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_lp = jnp.take_along_axis(logprobs, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    top_lp, top_ids = lax.top_k(logprobs, MAX_LOGPROBS)
    return token_lp, top_ids.astype(jnp.int32), top_lp


def apply_penalties(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's (and the OpenAI API's) rules, in its order: repetition on every token seen (transformers'
    RepetitionPenaltyLogitsProcessor), then frequency x count and presence on generated tokens."""
    seen = in_prompt | (counts > 0)
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def _rows_history(history: History, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's counts and prompt set ([W, V]); empty for rows without a slot."""
    has = (slots >= 0)[:, None]
    index = jnp.maximum(slots, 0)
    return jnp.where(has, history.counts[index], 0), has & history.in_prompt[index]


def _add_prompt_tokens(history: History, x: SamplingInput) -> History:
    num_slots = history.counts.shape[0]
    clear = _slot_index(x.clear_slot, num_slots)
    counts = history.counts.at[clear].set(0, mode="drop")
    in_prompt = history.in_prompt.at[clear].set(False, mode="drop")
    in_prompt = in_prompt.at[_slot_index(x.prompt_slot, num_slots), x.token_ids].set(True, mode="drop")
    return History(counts, in_prompt)


def _slot_index(slots: jax.Array, num_slots: int) -> jax.Array:
    """-1 -> num_slots, out of bounds, so that a scatter with mode="drop" skips it (-1 would wrap)."""
    return jnp.where(slots < 0, num_slots, slots)


def _ban(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    index = jnp.where(banned_ids < 0, logits.shape[1], banned_ids)
    return logits.at[rows, index].set(-jnp.inf, mode="drop")


def sample(
    logits: jax.Array,       # [S, V] float32
    temperature: jax.Array,  # [S] float32, 0 = greedy
    top_k: jax.Array,        # [S] int32, 0 = off
    top_p: jax.Array,        # [S] float32 in (0, 1]
    seeds: jax.Array,        # [S] uint32
    num_generated: jax.Array,  # [S] int32: the draw's key is (seed, tokens generated so far)
    min_p: jax.Array | None = None,  # [S] float32, 0 = off
) -> jax.Array:              # [S] int32
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = temperature > 0
    min_p = jnp.zeros_like(top_p) if min_p is None else min_p

    def draw(truncate: bool) -> jax.Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        masked = _mask_top_p(_mask_top_k(_mask_min_p(scaled, min_p), top_k), top_p) if truncate else scaled
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, num_generated)
        drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(sampling, drawn, greedy)

    if jax.default_backend() != "cpu":  # a device conditional would sync the host (module docstring)
        return draw(truncate=True)
    truncates = jnp.any(sampling & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)))

    def draw_some() -> jax.Array:
        return lax.cond(truncates, lambda: draw(True), lambda: draw(False))

    return lax.cond(jnp.any(sampling), draw_some, lambda: greedy)


def _mask_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """p < min_p * p_max  <=>  logit < logit_max + log(min_p): transformers' MinPLogitsWarper without the
    softmax (log 0 = -inf: min_p 0 keeps every token)."""
    threshold = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _mask_top_k(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    descending = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(descending, (k - 1)[:, None], axis=-1)
    return jnp.where(logits < kth, -jnp.inf, logits)


def _mask_top_p(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    descending = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(descending, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    # top_p 1 keeps every token (the rounded cumulative mass may pass 1 before the tail).
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    threshold = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)
