"""Engine throughput counters and the periodic engine-status log line (host side, no jax)."""

from __future__ import annotations

import logging
import time

from jaxcpp.outputs import EngineStats
from jaxcpp.scheduler import SchedulerOutput

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
        self.prompt_tokens_total += sched.num_tokens - sched.num_decodes

    def count_sampled(self, num_tokens: int) -> None:
        """Every sampled token, the first one (sampled by the prompt's last chunk) included."""
        self.generation_tokens_total += num_tokens

    def due(self) -> bool:
        """Time for the next status line (cheap: the engine builds its stats only when it is)."""
        return self.interval_s > 0 and time.monotonic() - self._last_time >= self.interval_s

    def log(self, s: EngineStats, chunking_report: str | None) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        prefill_tps = (self.prompt_tokens_total - self._last_prompt) / elapsed
        decode_tps = (self.generation_tokens_total - self._last_generation) / elapsed
        log.info("Engine status: running %d, waiting %d, pages used %d/%d (%.1f%%), prefill %.1f tok/s, "
                 "decode %.1f tok/s, preemptions %d, compilations since warm-up %d, prefix cache hit rate "
                 "%.1f%% (%d pages cached)",
                 s.num_running, s.num_waiting, s.num_pages_used, s.num_pages_total,
                 100.0 * s.num_pages_used / max(1, s.num_pages_total), prefill_tps, decode_tps,
                 s.num_preemptions_total, s.num_compilations_since_warmup, 100.0 * s.prefix_cache_hit_rate,
                 s.num_pages_cached)
        if chunking_report is not None:
            log.info(chunking_report)
        self._last_time, self._last_prompt, self._last_generation = (
            now, self.prompt_tokens_total, self.generation_tokens_total)
