"""Engine throughput counters and the periodic engine-status log line (host side, no jax)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from jaxcpp.chunking.controller import format_report
from jaxcpp.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from jaxcpp.engine import LLMEngine

log = logging.getLogger("jaxcpp.engine")


class StatsLogger:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0

    def count_scheduled(self, sched: SchedulerOutput) -> None:
        # Every chunk that samples makes a token: the decodes, and the last prefill chunk (first token).
        self.generation_tokens_total += sum(1 for chunk in sched.chunks if chunk.samples)
        self.prompt_tokens_total += sched.num_tokens - sched.num_decodes

    def maybe_log(self, engine: LLMEngine) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return
        prefill_tps = (self.prompt_tokens_total - self._last_prompt) / elapsed
        decode_tps = (self.generation_tokens_total - self._last_generation) / elapsed
        s = engine.stats()
        log.info("Engine status: running %d, waiting %d, pages used %d/%d (%.1f%%), prefill %.1f tok/s, "
                 "decode %.1f tok/s, preemptions %d, compilations since warm-up %d",
                 s.num_running, s.num_waiting, s.num_pages_used, s.num_pages_total,
                 100.0 * s.num_pages_used / max(1, s.num_pages_total), prefill_tps, decode_tps,
                 s.num_preemptions_total, s.num_compilations_since_warmup)
        if engine.chunking is not None:
            log.info(format_report(engine.chunking.report_counts()))
        self._last_time, self._last_prompt, self._last_generation = (
            now, self.prompt_tokens_total, self.generation_tokens_total)
