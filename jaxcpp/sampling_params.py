"""Per-request sampling parameters, validated once, on construction (host side, no jax).

Every front end builds one of these (the offline `LLM`, gRPC's `SamplingParameters`, the OpenAI
HTTP API's request body), so a bad value is refused the same way everywhere, with an error that names
the field. Names and defaults follow vLLM's `SamplingParams`. What runs where:

    on the device (jaxcpp.runtime.sampler)  penalties, min_tokens' ban of stop ids, temperature, min_p,
                                            top_k, top_p, the draw, logprobs and top logprobs
    in the engine (jaxcpp.core.scheduler)        max_tokens, stop_token_ids, ignore_eos, min_tokens
    at the edge (jaxcpp.output_processor)   n (one engine request per sample), stop strings, text
    on the host and the device               structured_outputs: the grammar's bitmask, filled on the host
                                            (jaxcpp.structured), applied by the sampler before the draw
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from jaxcpp.errors import InvalidRequestError
from jaxcpp.structured.constraint import StructuredOutputs

MAX_LOGPROBS = 20   # top log-probabilities the device computes per token (OpenAI's top_logprobs limit)
MAX_N = 128         # samples of one prompt
MAX_STOP_STRINGS = 16
MAX_BANNED_IDS = 8  # stop ids (EOS + stop_token_ids) min_tokens keeps from being sampled
FLOAT32_MAX = 3.4028234663852886e38  # temperatures past it are infinite on the device
INT32_MAX = 2**31 - 1  # the device's int32: every integer that reaches a step's arrays is checked against it


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16                  # tokens to generate at most
    temperature: float = 1.0              # 0 = greedy
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0                    # nucleus mass, in (0, 1]
    seed: int | None = None               # same seed => same tokens
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False              # keep going past the model's EOS
    n: int = 1                            # samples of the prompt (seeds seed, seed + 1, ...)
    min_p: float = 0.0                    # drop tokens less likely than min_p x the most likely one
    min_tokens: int = 0                   # EOS and stop_token_ids cannot be sampled before this many
    presence_penalty: float = 0.0         # subtracted once from the logit of every generated token
    frequency_penalty: float = 0.0        # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0       # logits of prompt and generated tokens: / it if > 0, * it if < 0
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, matched on the detokenized text
    include_stop_str_in_output: bool = False
    logprobs: int | None = None           # log-probability of each sampled token and its top-k (0: none)
    prompt_logprobs: int | None = None    # the same for every prompt token but the first
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, regex, choice or grammar to obey

    def __post_init__(self) -> None:
        self._check_limits()
        self._check_penalties()
        self._check_outputs()

    def _check_limits(self) -> None:
        # Ids no token has simply never match, but they must fit the engine's int32 (the proto's type).
        if not all(isinstance(t, int) and not isinstance(t, bool) and -INT32_MAX - 1 <= t <= INT32_MAX
                   for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"must be integers in [-2**31, 2**31), got "
                                      f"{self.stop_token_ids!r}")
        _integer("max_tokens", self.max_tokens, 1)
        if not 0.0 <= self.temperature <= FLOAT32_MAX:  # the device's float32; NaN fails too
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < _float32(self.top_p) <= 1.0:  # a top_p of 0 in float32 would keep no token at all
            raise InvalidRequestError("top_p", f"must be in (0, 1] (and above 0 as a float32), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k <= INT32_MAX:
            raise InvalidRequestError("top_k", f"must be an integer in [0, 2**31) (0 = off), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed!r}")
        _integer("n", self.n, 1, MAX_N)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        _integer("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"({self.min_tokens}) must not exceed max_tokens "
                                      f"({self.max_tokens})")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value!r}")
        if not 0.0 < _float32(self.repetition_penalty) <= FLOAT32_MAX:  # the device divides by it
            raise InvalidRequestError("repetition_penalty", f"must be a finite number > 0 (as a float32), got "
                                      f"{self.repetition_penalty!r}")

    def _check_outputs(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings, got "
                                      f"{self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _integer(name, value, 0, MAX_LOGPROBS)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidRequestError("structured_outputs", f"must be a StructuredOutputs, got "
                                      f"{type(self.structured_outputs).__name__}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def is_plain(self) -> bool:
        """Asks only for what every step carries (temperature, top-k, top-p, seed): read per chunk per step."""
        return (not self.has_penalties and self.min_p == 0.0 and self.min_tokens == 0
                and self.logprobs is None and self.prompt_logprobs is None)

    @property
    def reads_history_on_device(self) -> bool:
        """The device must see every prompt token of this request (penalties count them, prompt
        logprobs score them), so it cannot start from a cached prefix."""
        return self.has_penalties or self.prompt_logprobs is not None

    def sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of n: one sample each, seeds seed + index (as vLLM)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return replace(self, n=1, seed=seed)


def _integer(name: str, value: object, low: int, high: int = INT32_MAX) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        bound = f"in [{low}, {high}]" if high != INT32_MAX else f"in [{low}, 2**31)"
        raise InvalidRequestError(name, f"must be an integer {bound}, got {value!r}")


def _float32(value: float) -> float:
    """`value` as the device holds it: a positive number below float32's range becomes 0 there.
    Not a number (a string, None) passes through, for the range check to refuse."""
    try:
        return float(np.float32(value)) if abs(value) <= FLOAT32_MAX else value
    except TypeError:
        return value
