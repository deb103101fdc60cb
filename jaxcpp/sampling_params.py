"""Per-request sampling parameters, validated on construction (host side, no jax)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxcpp.errors import InvalidRequestError

FLOAT32_MAX = 3.4028234663852886e38  # temperatures past it are infinite on the device


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16                  # tokens to generate at most
    temperature: float = 1.0              # 0 = greedy
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0                    # nucleus mass, in (0, 1]
    seed: int | None = None               # same seed => same tokens
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False              # keep going past the model's EOS

    def __post_init__(self) -> None:
        if not all(isinstance(t, int) for t in self.stop_token_ids):  # ids no token has simply never match
            raise InvalidRequestError("stop_token_ids", f"must be integers, got {self.stop_token_ids!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= FLOAT32_MAX:  # the device's float32; NaN fails too
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed!r}")
