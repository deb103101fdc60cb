"""When a sequence is done, besides an abort: one of its stop ids, the model's EOS (unless `ignore_eos`),
its grammar complete, its max_tokens or the model's length. The scheduler asks once per sampled token
(`finish_reason`), and before a placeholder decode whether that decode could only be dropped (`at_length`)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxcpp.core.sequence import Sequence
from jaxcpp.errors import InvalidRequestError
from jaxcpp.sampling_params import MAX_BANNED_IDS, SamplingParams


@dataclass(frozen=True)
class StopRule:
    """The engine's part of the rule: the model's EOS ids and its length (the rest is each request's)."""

    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """"stop" or "length" if `token`, just received, ends `seq`; None if it goes on."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated():
            return "stop"  # the grammar is complete and allows nothing more (not even more whitespace)
        return "length" if self.at_length(seq) else None

    def at_length(self, seq: Sequence, ahead: int = 0) -> bool:
        """Done by length (its max_tokens, or the model's) once `ahead` more tokens are back."""
        return (len(seq.output_token_ids) + ahead >= seq.params.max_tokens
                or (self.max_model_len is not None and seq.num_tokens + ahead >= self.max_model_len))

    def banned_ids(self, params: SamplingParams, vocab_size: int) -> tuple[int, ...]:
        """The stop ids min_tokens keeps the device from sampling (EOS unless ignored, stop_token_ids):
        only ids of the vocabulary, since no other can be sampled (and the device indexes by them)."""
        if params.min_tokens == 0:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        banned = tuple(dict.fromkeys(t for t in (*eos, *params.stop_token_ids) if 0 <= t < vocab_size))
        if len(banned) > MAX_BANNED_IDS:
            raise InvalidRequestError("stop_token_ids", f"with min_tokens, at most {MAX_BANNED_IDS} stop ids "
                                      f"(EOS included) can be held back; got {len(banned)}")
        return banned
