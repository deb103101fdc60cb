"""An executor with no model and no jax: deterministic tokens, modelled step times, the real contract.

    engine = LLMEngine(config, executor=FakeExecutor(num_stages=2, latency=LatencyModel(...)))

Each sampled token depends only on the sequence's last token, its position and how many tokens it
has generated (`next_token`), so outputs do not depend on batching, chunking or preemption, exactly
as greedy outputs of the real engine do not; `expected_tokens(prompt, n)` replays the rule. With a
latency model, each micro-batch takes

    t = c + b·T + Σ_seq (γ·L + a·(2·L·x + x²))    (T: the padded tokens; x, L: each chunk and its prefix)

on every stage, on a virtual clock where the P stages run micro-batches as a flow shop (stage s starts a
batch when stage s-1 finished it and stage s finished the previous one): the timings `ack` returns are
what a real pipeline would measure under that model. `step_delay_s` really sleeps in `collect`, for
tests of a server under a slow engine. A step submitted with `feedback_from` reads its placeholder
decodes' input tokens from that step's tokens and starts once that step has left the last stage.
It never fails on its own (`add_failure_listener` keeps nothing). It is both KV sub-protocols
(disaggregation): it records offers and imports, and a pull arrives at once unless a test holds it.
Shapes count as programs: a step whose shape was not warmed up counts as a compilation, so the
compile guard means the same here as on a device.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.core.executor import FailureListener, HostPhase, Logprobs, StageTiming, StepRequest, StepResult
from jaxcpp.core.kv_transfer import KVOffer, KVPull, KVSource
from jaxcpp.core.step_input import StepInput, StepShape
from jaxcpp.sampling_params import MAX_LOGPROBS

# (last token id, its position, tokens the sequence generated so far) -> the next token
NextToken = Callable[[int, int, int], int]


def printable_next_token(last: int, position: int, num_generated: int) -> int:
    """The default rule: printable ASCII (32..126), so any vocabulary of 127 ids or more can hold it."""
    return 32 + (last * 31 + position * 17 + 7) % 95


def with_fed_back_tokens(step: StepInput, fed_back: np.ndarray) -> StepInput:
    """What the first stage sees: placeholder decodes' input tokens read from the step fed back."""
    rows = step.feedback_rows
    return dataclasses.replace(step, token_ids=np.where(rows >= 0, fed_back[np.maximum(rows, 0)], step.token_ids))


def fake_tokens(step: StepInput, next_token: NextToken = printable_next_token, eos_token_id: int | None = None,
                eos_after: int | None = None) -> np.ndarray:
    """Each sequence's next token by `next_token` from its last input token, position and count of
    generated tokens; the `eos_after`-th generated token is `eos_token_id`. [S] int32."""
    tokens = np.zeros(step.kv_lens.shape, np.int32)
    for i in range(int(step.num_seqs)):
        row = int(step.logits_indices[i])
        generated = int(step.num_generated[i])
        if eos_after is not None and generated + 1 == eos_after:
            assert eos_token_id is not None, "eos_after needs eos_token_id"
            tokens[i] = eos_token_id
        else:
            tokens[i] = next_token(int(step.token_ids[row]), int(step.positions[row]), generated)
    return tokens


def allowed_tokens(tokens: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Each row's token if its bitmask row allows it, else the next allowed id above it (cyclically):
    what a constrained row draws here."""
    out = tokens.copy()
    ids = np.arange(bitmask.shape[1] * 32)
    for i, token in enumerate(tokens[:bitmask.shape[0]]):
        allowed = ids[(bitmask[i, ids // 32] >> (ids % 32)) & 1 == 1]
        if allowed.size and token not in allowed:
            later = allowed[allowed > token]
            out[i] = later[0] if later.size else allowed[0]
    return out


def next_tokens(step: StepInput, next_token: NextToken = printable_next_token) -> np.ndarray:
    """What each token row predicts (its one-hot logits' argmax), as if it were the last of its sequence."""
    return np.array([next_token(int(t), int(p), 0) for t, p in zip(step.token_ids, step.positions, strict=True)],
                    np.int32)


def modelled_seconds(model: LatencyModel, step: StepInput) -> float:
    """t = c + b·T + Σ_seq (γ·L + a·(2·L·x + x²)) for one stage of this micro-batch (T: padded tokens)."""
    n = int(step.num_seqs)
    x = np.diff(step.cu_q_lens[: n + 1]).astype(np.float64)
    prefix = step.kv_lens[:n].astype(np.float64) - x
    return float(model.c + model.b * step.num_tokens_padded
                 + np.sum(model.gamma * prefix + model.a * (2 * prefix * x + x * x)))


@dataclass
class FakePull:
    """A pull of the fake executor: it arrives when `arrived` is True (at once, unless a test holds it); an
    exception there is a transfer that failed."""

    transfer_id: int
    num_pages: int
    arrived: bool | Exception = True
    nbytes: int = 0


class FakeExecutor:
    def __init__(self, *, num_stages: int = 1, next_token: NextToken = printable_next_token,
                 eos_token_id: int | None = None, eos_after: int | None = None,
                 latency: LatencyModel | None = None, step_delay_s: float = 0.0, vocab_size: int = 128) -> None:
        self.max_in_flight = num_stages
        self.num_stages = num_stages
        self.next_token = next_token
        self.eos_token_id = eos_token_id
        self.eos_after = eos_after          # the n-th generated token is EOS (None: never)
        self.latency = latency
        self.step_delay_s = step_delay_s
        self.vocab_size = vocab_size        # the width of the one-hot logits it returns when asked
        self.steps: list[StepInput] = []    # every step submitted after warm-up, for tests to inspect
        self.host_phases: deque[HostPhase] = deque(maxlen=100_000)  # what the engine reported of its time
        self._in_flight: dict[int, tuple[StepResult, float, np.ndarray]] = {}  # step id -> (result, done, tokens)
        self._stage_free = [0.0] * num_stages   # the virtual clock: when each stage is next idle
        self.clock = 0.0                        # when the last collected micro-batch left the last stage
        self._programs: set[tuple[int, int]] = set()
        self._compilations = 0
        self._warm = False
        self.offered: list[tuple[int, list[int]]] = []  # (transfer id, pages) of each offer_kv
        self.pulls: list[FakePull] = []                 # each pull_kv's, in order
        self.pulls_arrive = True                        # False: a pull lands when a test sets its `arrived`
        self.imported: list[FakePull] = []              # each pull written by import_kv

    @staticmethod
    def expected_tokens(prompt: list[int], n: int, next_token: NextToken = printable_next_token) -> list[int]:
        """The first n tokens generated for `prompt` (before any stop)."""
        out: list[int] = []
        last, position = prompt[-1], len(prompt) - 1
        for i in range(n):
            last, position = next_token(last, position, i), position + 1
            out.append(last)
        return out

    # ---- the Executor contract -----------------------------------------------------------------
    def warmup(self, shape: StepShape) -> float:
        for num_tokens in shape.buckets:
            self._programs.add((num_tokens, min(num_tokens, shape.max_num_seqs)))
        self._compilations = len(self._programs)
        self._warm = True
        return 0.0

    def submit(self, request: StepRequest) -> None:
        r, step, step_id, feedback_from = request, request.step, request.step_id, request.feedback_from
        shape = (step.num_tokens_padded, int(step.kv_lens.shape[0]))
        if shape not in self._programs:
            self._programs.add(shape)
            self._compilations += 1
        if self._warm:
            self.steps.append(step)
        source = self._in_flight[feedback_from] if feedback_from is not None else None
        tokens = self._tokens(with_fed_back_tokens(step, source[2]) if source else step)
        if r.bitmask is not None:
            tokens = allowed_tokens(tokens, r.bitmask)
        width = max(self.vocab_size, int(tokens.max(initial=0)) + 1)
        logits = np.eye(width, dtype=np.float32)[tokens] if r.want_logits else None
        timings = self._run_stages(step_id, step, source[1] if source else 0.0)
        logprobs = self.one_hot_logprobs(tokens, tokens, width) if r.want_logprobs else None
        prompt = self.one_hot_logprobs(next_tokens(step, self.next_token), step.prompt_targets, width) \
            if r.want_prompt_logprobs else None
        result = StepResult(tokens if r.want_tokens else None, logits, timings if r.ack else (), logprobs, prompt)
        self._in_flight[step_id] = (result, timings[-1].done, tokens)

    def collect(self, step_id: int) -> StepResult:
        result, done, _ = self._in_flight.pop(step_id)
        self.clock = max(self.clock, done)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return result

    def time_attention_free_forward(self, num_tokens: int) -> float:
        return 0.0 if self.latency is None else self.latency.c + self.latency.b * num_tokens

    def num_compilations(self) -> int:
        return self._compilations

    @property
    def mla_rebuild_weight(self) -> float | None:
        return None  # no model, no MLA

    def record_host_phases(self, phases: list[HostPhase]) -> None:
        self.host_phases.extend(phases)

    def add_failure_listener(self, callback: FailureListener) -> None:
        pass  # it fails only inside submit or collect

    def close(self) -> None:
        pass

    # ---- the KV sub-protocols (disaggregation): offers and pulls that exist only here -------------
    def offer_kv(self, transfer_id: int, pages: list[int]) -> KVOffer:
        self.offered.append((transfer_id, list(pages)))
        return KVOffer((KVSource("fake", 0, 1),), len(pages))

    def pull_kv(self, offer: KVOffer, transfer_id: int) -> FakePull:
        self.pulls.append(FakePull(transfer_id, offer.num_pages, arrived=self.pulls_arrive))
        return self.pulls[-1]

    def kv_arrived(self, pull: KVPull) -> bool:
        arrived = cast(FakePull, pull).arrived
        if isinstance(arrived, Exception):
            raise arrived  # a failed transfer
        return arrived

    def import_kv(self, pull: KVPull, pages: list[int]) -> None:
        assert len(pages) == cast(FakePull, pull).num_pages, (pages, pull)
        self.imported.append(cast(FakePull, pull))

    # ---- internals -----------------------------------------------------------------------------
    def _tokens(self, step: StepInput) -> np.ndarray:
        return fake_tokens(step, self.next_token, self.eos_token_id, self.eos_after)

    @staticmethod
    def one_hot_logprobs(predicted: np.ndarray, chosen: np.ndarray, width: int) -> Logprobs:
        """Log-softmax of one-hot logits (1 at `predicted`, 0 elsewhere): what the device computes of them."""
        log_z = np.log(np.e + width - 1)
        top_ids = np.empty((len(predicted), MAX_LOGPROBS), np.int32)
        for i, p in enumerate(predicted):
            others = [t for t in range(MAX_LOGPROBS) if t != p][:MAX_LOGPROBS - 1]
            top_ids[i] = [p, *others]
        top = np.where(top_ids == predicted[:, None], 1.0 - log_z, -log_z).astype(np.float32)
        chosen_lp = np.where(chosen == predicted, 1.0 - log_z, -log_z).astype(np.float32)
        return Logprobs(chosen_lp, top_ids, top)

    def step_seconds(self, step: StepInput) -> float:
        """The latency model's time for one stage of this micro-batch (0 without a model)."""
        return 0.0 if self.latency is None else modelled_seconds(self.latency, step)

    def _run_stages(self, step_id: int, step: StepInput, fed_back_done: float) -> tuple[StageTiming, ...]:
        """`fed_back_done`: a step that takes tokens from another starts once that one left the pipe."""
        seconds = self.step_seconds(step)
        timings, ready = [], max(self._stage_free[0], self.clock, fed_back_done)
        for s in range(self.num_stages):
            start = max(ready, self._stage_free[s])
            done = start + seconds
            timings.append(StageTiming(step_id, s, step.num_tokens_padded, self._warm, ready, ready, start, done))
            self._stage_free[s] = ready = done
        return tuple(timings)
