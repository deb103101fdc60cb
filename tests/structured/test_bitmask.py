"""The step bitmask against the grammar library's own matcher, on random token sequences; and the
sampler's use of it on the device (bits past the vocabulary cropped, free rows untouched)."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import llguidance
import numpy as np
import pytest

from jaxcpp.runtime.sampler import apply_bitmask, sample
from jaxcpp.structured.constraint import StructuredOutputs, bitmask_words
from jaxcpp.structured.grammar import GrammarCompiler, library_tokenizer
from jaxcpp.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "xs": {"type": "array", "items": {
    "enum": ["a", "bc"]}, "maxItems": 3}}, "required": ["n"]}
CONSTRAINTS = [StructuredOutputs.from_schema(SCHEMA), StructuredOutputs(json_object=True),
               StructuredOutputs(regex=r"(ab|c)+d?"), StructuredOutputs(choice=("yes", "no", "nope")),
               StructuredOutputs(grammar='start: item ("," item)*\nitem: /[0-9]+/ | "x"')]


def allowed(bitmask: np.ndarray, row: int, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("vocab", [TOK.vocab_size, 300])  # 300: a model vocabulary padded past the tokenizer's
@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_mask_is_the_library_matchers_on_random_walks(constraint: StructuredOutputs, vocab: int) -> None:
    grammars = GrammarCompiler(TOK, vocab)
    reference = llguidance.LLMatcher(library_tokenizer(TOK, vocab), constraint.grammar_text, log_level=0)
    rng = random.Random(0)
    for _ in range(5):  # walks from the start, each its own request's matcher
        matcher, ref = grammars.matcher(grammars.compile(constraint)), reference.deep_copy()
        bitmask = np.full((2, bitmask_words(vocab)), -1, np.int32)
        for _ in range(40):
            matcher.fill_bitmask(bitmask, 1)
            ok = allowed(bitmask, 1, vocab)
            # the library's own check, token by token, on an independent matcher in the same state
            assert ok == {t for t in range(TOK.vocab_size) if ref.validate_tokens([t]) == 1}
            assert not ok & set(range(TOK.vocab_size, vocab)), "an id past the tokenizer's was allowed"
            assert allowed(bitmask, 0, vocab) == set(range(vocab)), "another row was written"
            token = rng.choice(sorted(ok))
            assert matcher.accept_token(token) and ref.consume_token(token)
            if matcher.is_terminated():
                assert token in TOK.eos_token_ids or ok == {token} or ref.is_stopped()
                break
    assert grammars.num_compiled == 1  # one compile for the walks: the rest from the cache
    grammars.close()


def test_a_bad_grammar_fails_its_compile_naming_the_field() -> None:
    grammars = GrammarCompiler(TOK, TOK.vocab_size)
    bad = StructuredOutputs(grammar='start: "a"', field_name="structured_outputs")
    assert grammars.matcher(grammars.compile(bad)).accept_token(ord("a"))
    grammars.close()


def test_the_device_applies_the_mask_and_crops_its_padding() -> None:
    vocab, rows = 70, 3  # 3 words = 96 bits: 26 bits past the vocabulary, set, must be ignored
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2, (rows, 96)).astype(bool)
    bits[:, :vocab][bits[:, :vocab].sum(1) == 0, 0] = True
    bits[2] = True  # a free row: all ones
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)  # bit b of word w: token 32 w + b
    bitmask = (bits.reshape(rows, 3, 32) * weights).sum(-1).astype(np.uint32).view(np.int32)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)), jnp.float32)
    masked = np.asarray(jax.jit(apply_bitmask)(logits, jnp.asarray(bitmask)))
    np.testing.assert_array_equal(np.isfinite(masked), bits[:, :vocab])
    np.testing.assert_array_equal(masked[2], np.asarray(logits[2]))  # a free row is untouched
    draw = jax.jit(sample)
    for seed in range(20):  # a draw never lands on a forbidden token, greedy or sampled, top-k or not
        tokens = np.asarray(draw(jnp.asarray(masked), jnp.asarray([0.0, 1.0, 1.0]), jnp.asarray([0, 5, 0]),
                                 jnp.ones(rows), jnp.full(rows, seed, jnp.uint32), jnp.zeros(rows, jnp.int32)))
        assert all(bits[r, t] for r, t in enumerate(tokens))
