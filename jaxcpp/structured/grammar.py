"""The grammar library behind one small interface (host side, no jax): llguidance.

    grammars = GrammarCompiler(tokenizer, vocab_size)     # the model's tokenizer, its (padded) vocab
    future = grammars.compile(constraint)                 # a worker thread; cached by the constraint
    matcher = future.result()                              # a fresh Matcher for one request
    matcher.fill_bitmask(row)      # row: [words] int32, bit t of word t // 32 set = token t allowed
    matcher.accept_token(t)        # advance on the sampled token (False: the grammar forbids it)
    matcher.is_terminated()        # nothing may follow: the request is done
    matcher.rollback(n)            # undo the last n tokens

Why llguidance rather than xgrammar: the engine is JAX and must not pull in a second framework, and
xgrammar 0.2 requires torch, transformers and triton at run time; llguidance is one 3 MB abi3 wheel
with no dependencies, compiles a grammar lazily (no per-vocabulary precompute: a large schema is ready
in milliseconds), fills the same int32 bitmask layout through numpy, and serves vLLM's "guidance"
backend. Its matcher never raises on user errors: a grammar it cannot build shows as `is_error()`.

The bitmask covers the model's vocabulary (`vocab_size`, the logits' width), which may be padded past
the tokenizer's: the library fills the words of the tokenizer's ids and the rest are cleared, so an id
the tokenizer has no bytes for is never allowed in a constrained row (the device crops the bits past
`vocab_size`). Compiling a grammar builds a matcher in the pool (llguidance drops the
GIL while it does); the cache keeps that pristine matcher per constraint and every request gets a
`deep_copy` (microseconds), so a second request with the same schema does not compile again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from jaxcpp.errors import InvalidRequestError
from jaxcpp.structured.constraint import StructuredOutputs, bitmask_words
from jaxcpp.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

COMPILE_THREADS = 2
CACHE_SIZE = 256  # compiled constraints kept (least recently used first out)


class Matcher:
    """One request's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._m = matcher
        self._words = words  # the tokenizer's vocabulary in words: the model's may be wider

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row `row` of a C-contiguous [rows, words] int32 bitmask: the tokens the grammar allows next
        (EOS only where it accepts); every id past the tokenizer's vocabulary forbidden."""
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"] and bitmask.shape[1] >= self._words
        ours = bitmask[row, :self._words]
        self._m.unsafe_compute_mask_ptr(ours.ctypes.data, ours.nbytes)  # what llguidance.numpy's fill does
        bitmask[row, self._words:] = 0

    def accept_token(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class _ByteTokens:
    """The byte tokenizer as llguidance's `TokenizerWrapper` reads one: each id's bytes, specials marked."""

    def __init__(self, tok: ByteTokenizer) -> None:
        self.eos_token_id, self.bos_token_id = tok.eos_token_ids[0], tok.bos_token_id
        self.special_token_ids = [i for i in range(tok.NUM_BYTES, tok.vocab_size)]
        self.tokens = [bytes([i]) for i in range(tok.NUM_BYTES)] + [
            b"\xff<special_%d>" % i for i in self.special_token_ids]  # 0xff: llguidance's special prefix

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def library_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The model's tokenizer as the library's, over `vocab_size` ids (the logits' width)."""
    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(_ByteTokens(tokenizer))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos or None)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None)
    raise TypeError(f"no grammar support for tokenizer {type(tokenizer).__name__}")


class GrammarCompiler:
    """Compiles constraints in a small worker pool, each once (an LRU cache keyed by the constraint)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, threads: int = COMPILE_THREADS) -> None:
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._tokenizer_source = tokenizer
        self._tokenizer: Future[llguidance.LLTokenizer] = self._pool.submit(library_tokenizer, tokenizer, vocab_size)
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, constraint: StructuredOutputs) -> Future[llguidance.LLMatcher]:
        """The compiled (pristine) matcher of `constraint`, compiling it in the pool on a miss."""
        key = constraint.grammar_text
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._build, constraint)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return future

    def _build(self, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), constraint.grammar_text, log_level=0)
        self.num_compiled += 1
        if matcher.is_error():
            raise InvalidRequestError(f"{constraint.field_name}.{constraint.kind}",
                                      f"cannot be compiled: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: Future[llguidance.LLMatcher]) -> Matcher:
        """A request's own matcher from a finished compile (raises its error, if it failed)."""
        return Matcher(compiled.result().deep_copy(), bitmask_words(self._tokenizer.result().vocab_size))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
