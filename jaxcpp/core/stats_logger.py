"""Engine throughput counters and the periodic engine-status log line (host side, no jax).

The engine hands over the time of every step that did work (`add_busy`). A line is due every
`interval_s` while there is work and never while the engine idles, and its prefill and decode rates
are tokens over the busy time since the last line: a request that ran at 150 tok/s reads 150 tok/s
however long the engine then idled (averaged over the wall clock it read 0.0 after 10 s idle).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jaxcpp.core.outputs import EngineStats
from jaxcpp.core.scheduler_output import SchedulerOutput

log = logging.getLogger("jaxcpp.core.engine")


class StatsLogger:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._clock = clock
        self._last_time = clock()
        self._last_prompt = 0
        self._last_generation = 0
        self._busy_s = 0.0  # since the last line
        self._working = False  # the last step did work

    def add_busy(self, seconds: float) -> None:
        """A step took `seconds` doing work (0: it found nothing to do)."""
        self._busy_s += seconds
        self._working = seconds > 0

    def count_scheduled(self, sched: SchedulerOutput) -> None:
        self.prompt_tokens_total += sched.num_tokens - sched.num_decodes

    def count_sampled(self, num_tokens: int) -> None:
        """Every sampled token, the first one (sampled by the prompt's last chunk) included."""
        self.generation_tokens_total += num_tokens

    def due(self) -> bool:
        """Time for the next status line: the interval is over and the engine is working (cheap: the
        engine builds its stats only when it is)."""
        return self.interval_s > 0 and self._working and self._clock() - self._last_time >= self.interval_s

    def log(self, s: EngineStats, chunking_report: str | None) -> None:
        busy = max(self._busy_s, 1e-9)
        prefill_tps = (self.prompt_tokens_total - self._last_prompt) / busy
        decode_tps = (self.generation_tokens_total - self._last_generation) / busy
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
            self._clock(), self.prompt_tokens_total, self.generation_tokens_total)
        self._busy_s = 0.0
