"""The real engine on a fake executor, for fast gRPC tests: real validation, scheduling, pages and stats,
deterministic tokens (`FakeExecutor.expected_tokens`), no jax. The bundled tiny model's folder gives the
config and the byte tokenizer; no weights are read."""

from __future__ import annotations

from typing import Any

from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor, printable_next_token

EOS = 257  # the tiny model's end-of-sequence id
FAKE_ENGINE_FLAGS: dict[str, Any] = dict(model="tiny", max_model_len=512, page_size=16, num_pages=257,
                                         max_num_batched_tokens=64, max_num_seqs=32, log_stats_interval_s=0)
expected_tokens = FakeExecutor.expected_tokens


def fake_engine(*, step_delay_s: float = 0.0, eos_after: int | None = None, next_token=printable_next_token,
                **flags: Any) -> LLMEngine:
    """`step_delay_s` slows every step (cancellation races); `eos_after=n` makes the n-th token EOS."""
    executor = FakeExecutor(step_delay_s=step_delay_s, eos_token_id=EOS, eos_after=eos_after,
                            next_token=next_token)
    return LLMEngine(EngineConfig.from_kwargs(**{**FAKE_ENGINE_FLAGS, **flags}), executor=executor)
