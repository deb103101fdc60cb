"""Prometheus metrics of the gRPC server (prometheus-client), one registry per server.

Latency histograms are observed once per finished request, on the engine thread, from the
engine's own `RequestMetrics` (TTFT, TPOT, every ITL, end-to-end). Load figures (queue sizes, KV
pages, compilations, dynamic-chunking state) are read at scrape time from the latest `EngineStats`
snapshot the engine thread published, so a scrape never touches the engine; the prefix cache's
queried and hit tokens and evictions are counters (vLLM's names: prefix_cache_queries/hits), its hit
rate and cached pages gauges.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxcpp.core.outputs import EngineStats, RequestOutput

# Seconds; TTFT spans a decode step on a GPU up to a long CPU prefill.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def split_dynamic_chunking(state: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The engine's dynamic-chunking state as numbers (counters, coefficients) and text (state, policy)."""
    values = {key: float(value) for key, value in state.items() if isinstance(value, bool | int | float)}
    return values, {key: str(value) for key, value in state.items() if key not in values}


class _StatsCollector(Collector):
    """Gauges and counters from the last EngineStats snapshot (engine totals stay counters)."""

    def __init__(self, snapshot: Callable[[], tuple[EngineStats | None, int]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats, in_flight = self._snapshot()
        yield GaugeMetricFamily("jaxcpp_requests_in_flight",
                                "Generate calls the server holds (queued for the engine, waiting or running)",
                                value=in_flight)
        if stats is None:
            return
        for f in EngineStats.count_fields():  # one metric per count that names one (`EngineStats`)
            name, doc, value = f.metadata["metric"], f.metadata["doc"], getattr(stats, f.name)
            if name:
                family = CounterMetricFamily if f.name.endswith("_total") else GaugeMetricFamily
                yield family(name, doc, value=value)
        derived = {
            "jaxcpp_kv_cache_usage_ratio": ("fraction of KV-cache pages in use",
                                            stats.num_pages_used / max(stats.num_pages_total, 1)),
            "jaxcpp_prefix_cache_hit_rate": ("prefix-cache hit tokens / queried tokens since start",
                                             stats.prefix_cache_hit_rate),
        }
        for name, (doc, value) in derived.items():
            yield GaugeMetricFamily(name, doc, value=value)
        dynamic = GaugeMetricFamily("jaxcpp_dynamic_chunking", "dynamic chunking state and counters, by name",
                                    labels=["name"])
        labels = GaugeMetricFamily("jaxcpp_dynamic_chunking_info", "dynamic chunking textual state "
                                   "(state, policy), as a 1-valued gauge", labels=["name", "value"])
        values, texts = split_dynamic_chunking(stats.dynamic_chunking)
        for key, value in sorted(values.items()):
            dynamic.add_metric([key], value)
        for key, text in sorted(texts.items()):
            labels.add_metric([key, text], 1.0)
        yield dynamic
        yield labels


class ServingMetrics:
    """The server's metrics. Thread-safe: prometheus-client metrics lock internally."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._stats: EngineStats | None = None
        self._in_flight = 0
        r = self.registry
        self.ttft = Histogram("jaxcpp_time_to_first_token_seconds", "time to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("jaxcpp_time_per_output_token_seconds",
                              "mean time per output token after the first, per request",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("jaxcpp_inter_token_latency_seconds", "time between consecutive output tokens",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("jaxcpp_e2e_request_latency_seconds", "admission to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.finished = Counter("jaxcpp_requests_finished", "finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("jaxcpp_requests_rejected", "Generate calls refused, by gRPC status",
                                ["code"], registry=r)
        r.register(_StatsCollector(self._snapshot))
        self._http: Any = None

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        self.finished.labels(output.finish_reason or "unknown").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        for gap in m.itl:
            self.itl.observe(gap)
        n = output.num_generated
        if n > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (n - 1))

    def finished_counts(self) -> dict[str, int]:
        """Requests finished so far, by finish reason (stop, length, abort, error)."""
        return {s.labels["finish_reason"]: int(s.value) for metric in self.finished.collect()
                for s in metric.samples if s.name.endswith("_total")}

    def set_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self._stats = stats

    def set_in_flight(self, n: int) -> None:
        with self._lock:
            self._in_flight = n

    def _snapshot(self) -> tuple[EngineStats | None, int]:
        with self._lock:
            return self._stats, self._in_flight

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics on host:port (port 0: any free one); returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
