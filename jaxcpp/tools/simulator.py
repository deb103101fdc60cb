"""A pipeline simulator: P stages under the latency model, chunks from any policy, TTFT per request.

How it moves: a step loop like the engine's. Whenever stage 0 is free and the engine's in-flight rule
(`jaxcpp.core.in_flight`, with depth `max_in_flight`) lets one more batch in, the scheduler forms a batch:
it tells the policy how many requests could prefill (`observe_step`, so the controller's gate decides
as it would in the engine), then asks it for a chunk per request (`prefill_chunk`), first come first
served, until the token budget is spent. The policy is a `jaxcpp.core.chunk_sizer.ChunkSizer`, the engine's
one chunk-sizing protocol: the controller, or `FixedPolicy` / `PlanPolicy` here. The batch then flows
through the stages in order (stage j takes w_j·t, a hop between stages costs hop_s + hop_s_per_token·n),
each stage taking batches in order. A request's TTFT is when its last chunk leaves the last stage.

`simulate_engine` instead drives the real engine (scheduler, pages, controller) on a `FakeExecutor`
whose virtual clock runs the same flow shop: the two agree for a lone prompt (a test checks it).

The simulated prefill worker runs prefills only (as the prefill side of a disaggregated deployment):
no decodes share its steps. A batch's time is c once plus each chunk's (t − c). A policy that has
`record_timing` gets the time of every sole-prefill batch on the slowest stage, optionally with noise,
so calibration can be exercised end to end.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.core.chunk_sizer import ChunkSizer, FixedChunkSizer
from jaxcpp.core.in_flight import InFlight

if TYPE_CHECKING:
    from jaxcpp.core.engine import LLMEngine


class FixedPolicy(FixedChunkSizer):
    """Fixed chunking: as much of the prompt as the budget allows, at most `chunk`."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def prefill_chunk(self, seq: Any, budget_left: int, step_tokens: int) -> int:
        return min(self.chunk, budget_left, seq.num_remaining)


class PlanPolicy(FixedChunkSizer):
    """Replays a precomputed plan (any policy's) for every request, in order."""

    def __init__(self, chunks: Sequence[int]) -> None:
        self.chunks = list(chunks)
        self._next: dict[Hashable, int] = {}

    def prefill_chunk(self, seq: Any, budget_left: int, step_tokens: int) -> int:
        i = self._next.get(seq.request_id, 0)
        self._next[seq.request_id] = i + 1
        return min(self.chunks[i], budget_left, seq.num_remaining)


@dataclass(frozen=True)
class Pipeline:
    model: LatencyModel                           # time on a stage of weight 1 (the slowest stage)
    num_stages: int
    stage_weights: tuple[float, ...] | None = None
    hop_s: float = 0.0                            # per stage-to-stage transfer
    hop_s_per_token: float = 0.0
    max_in_flight: int | None = None              # the in-flight depth (default: num_stages, as the PP
                                                  # head's; + 1 for async scheduling)

    def weights(self) -> tuple[float, ...]:
        return self.stage_weights or (1.0,) * self.num_stages

    def batch_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Time of one forward holding these (prefix, chunk) pieces: c once, the rest per piece."""
        m = self.model
        return m.c + sum(float(m.predict(float(p), float(x))) - m.c for p, x in chunks)


@dataclass(frozen=True)
class SimRequest:
    request_id: Hashable
    arrival_s: float
    prompt_len: int


@dataclass(frozen=True)
class ClosedLoop:
    """`concurrency` clients, each sending its next prompt `think_s` after its last one's first token."""

    concurrency: int
    num_requests: int
    prompt_len: int
    think_s: float = 0.0


@dataclass(frozen=True)
class StageSpan:
    batch: int
    stage: int
    start: float
    end: float
    pieces: tuple[tuple[Hashable, int, int], ...]  # (request, prefix, chunk)


@dataclass
class SimResult:
    ttft: dict[Hashable, float] = field(default_factory=dict)
    chunks: dict[Hashable, list[int]] = field(default_factory=dict)
    spans: list[StageSpan] = field(default_factory=list)
    end_s: float = 0.0

    @property
    def mean_ttft(self) -> float:
        return float(np.mean(list(self.ttft.values())))

    @property
    def throughput(self) -> float:
        """Requests per second over the whole run."""
        return len(self.ttft) / self.end_s if self.end_s > 0 else 0.0


def poisson_arrivals(rate_per_s: float, num_requests: int, prompt_len: int | Sequence[int],
                     seed: int = 0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate_per_s, num_requests))
    lens = [prompt_len] * num_requests if isinstance(prompt_len, int) else list(prompt_len)
    return [SimRequest(i, float(t), int(n)) for i, (t, n) in enumerate(zip(times, lens, strict=True))]


@dataclass
class _Live:
    """A request in flight, shaped like the `Sequence` a ChunkSizer is asked about."""

    request: SimRequest
    scheduled: int = 0

    @property
    def request_id(self) -> Hashable:
        return self.request.request_id

    @property
    def num_computed_tokens(self) -> int:
        return self.scheduled

    @property
    def num_remaining(self) -> int:
        return self.request.prompt_len - self.scheduled


def simulate(pipeline: Pipeline, policy: ChunkSizer, budget: int,
             requests: Sequence[SimRequest] | ClosedLoop, timing_noise: float = 0.0,
             seed: int = 0) -> SimResult:
    """Run the workload to completion under `policy` (any `ChunkSizer`: the controller, FixedPolicy...)."""
    rng = np.random.default_rng(seed)
    loop = requests if isinstance(requests, ClosedLoop) else None
    initial = ([SimRequest(i, 0.0, loop.prompt_len) for i in range(min(loop.concurrency, loop.num_requests))]
               if loop else list(requests))  # type: ignore[arg-type]  # not a ClosedLoop here
    pending = [(r.arrival_s, i, r) for i, r in enumerate(initial)]
    heapq.heapify(pending)
    issued = len(initial)
    weights = pipeline.weights()
    stage_free = [0.0] * pipeline.num_stages
    in_flight: InFlight[float] = InFlight(pipeline.max_in_flight or pipeline.num_stages)  # done times
    live: list[_Live] = []
    result = SimResult()
    now = 0.0
    while pending or live:
        if not live:
            now = max(now, pending[0][0])
        while not in_flight.has_room():  # the engine's rule: collect the oldest
            now = max(now, in_flight.popleft())
        now = max(now, stage_free[0])
        while pending and pending[0][0] <= now:
            live.append(_Live(heapq.heappop(pending)[2]))
        if not live:
            continue
        policy.observe_step(len(live))
        pieces, left = [], budget
        for entry in live:
            if left <= 0:
                break
            size = min(policy.prefill_chunk(entry, left, budget - left), left, entry.num_remaining)
            if size > 0:
                pieces.append((entry, entry.scheduled, size))
                entry.scheduled += size
                left -= size
        if not pieces:
            raise RuntimeError("the policy scheduled no tokens for a step with waiting prompts")
        forward = pipeline.batch_time([(p, x) for _, p, x in pieces])
        arrive, tokens = now, sum(x for _, _, x in pieces)
        batch = len(result.spans) // pipeline.num_stages
        named = tuple((e.request.request_id, p, x) for e, p, x in pieces)
        for stage, weight in enumerate(weights):
            start = max(stage_free[stage], arrive)
            stage_free[stage] = start + weight * forward
            result.spans.append(StageSpan(batch, stage, start, stage_free[stage], named))
            arrive = stage_free[stage] + pipeline.hop_s + pipeline.hop_s_per_token * tokens
        done = stage_free[-1]
        in_flight.append(done, False)  # prompt chunks only: no decode in flight
        measured = max(weights) * forward * (1.0 + timing_noise * rng.uniform(-1.0, 1.0))
        entry, prefix, size = pieces[0]
        policy.record_timing(size, prefix, measured, len(pieces) == 1, entry.request.request_id)
        for entry, _, size in pieces:
            r = entry.request
            result.chunks.setdefault(r.request_id, []).append(size)
            if entry.scheduled == r.prompt_len:
                result.ttft[r.request_id] = done - r.arrival_s
                live.remove(entry)
                policy.finish_request(r.request_id)
                if loop and issued < loop.num_requests:
                    heapq.heappush(pending, (done + loop.think_s, issued,
                                             SimRequest(issued, done + loop.think_s, loop.prompt_len)))
                    issued += 1
        result.end_s = max(result.end_s, done)
    return result


def simulate_plan(pipeline: Pipeline, chunks: Sequence[int]) -> SimResult:
    """One prompt of sum(chunks) tokens, alone, cut exactly as `chunks`."""
    total = int(sum(chunks))
    return simulate(pipeline, PlanPolicy(list(chunks)), max(chunks), [SimRequest(0, 0.0, total)])


def simulate_engine(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, float]:
    """TTFT of each prompt (all arriving at 0) on the real engine over a FakeExecutor's virtual clock:
    the real scheduler and chunk controller size every chunk, the fake's flow shop times them."""
    from jaxcpp.core.fake_executor import FakeExecutor
    from jaxcpp.sampling_params import SamplingParams

    fake = engine.executor
    if not isinstance(fake, FakeExecutor):
        raise TypeError("simulate_engine needs an engine built on a FakeExecutor")
    start = fake.clock
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    ttft: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ttft.setdefault(out.request_id, fake.clock - start)
    return ttft
