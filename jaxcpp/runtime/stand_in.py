"""A timed stand-in for a stage's device: no model runs, each forward is a wait of the latency model.

    jaxcpp serve ... --pipeline-parallel-size 4 --distributed-executor-backend mp \\
        --stand-in-latency 5.14e-10,9.51e-06,0.005,8.38e-07 [--stand-in-jitter 0.02]

For benchmarks and load tests only (every stage process and the head log it as a warning): it measures
the runtime itself (the scheduler, chunk controller, calibration, async scheduling, control channel,
hops and head) at the scale the product is for, 128K-256K-token prompts on PP 2-8, free of this
machine's compute. Everything but the model call is the production code of a stage process:

    first stage:  the step's token ids, placeholder decodes' ids read from the fed-back tokens (as the
                  real first stage embeds them) -> int32 [T] activations
    other stages: the activations pulled through the real transfer server (`jax.experimental.transfer`)
    every stage:  waits t(L, x) = c + b·T + Σ_seq (γ·L + a·(2·L·x + x²)) on the wall clock, times a
                  seeded jitter factor (1 + jitter·N(0, 1)), clipped at 0
    last stage:   tokens from the fake executor's deterministic rule (`jaxcpp.core.fake_executor.fake_tokens`)

so a "forward" lasts the modelled time (the stand-in's own bookkeeping runs inside it) and everything
around it, the hops, control channel and head, is what the runtime really costs.
An all-padding step (warm-up) does not wait; the attention-free forward of the start-up sweep waits
c + b·T. Nothing is compiled: the activations are the token ids, small enough for any prompt length.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.core.fake_executor import FakeExecutor, fake_tokens, modelled_seconds, next_tokens, with_fed_back_tokens
from jaxcpp.core.step_input import StepShape, unpack
from jaxcpp.runtime.sampler import SampledTokens
from jaxcpp.runtime.stage import StageInput, StepOutput

log = logging.getLogger(__name__)


class OneHotLogits:
    """The logits a stand-in 'samples' from, materialised only if the head asked for them."""

    def __init__(self, tokens: np.ndarray, vocab_size: int) -> None:
        self.tokens, self.vocab_size = tokens, vocab_size

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.eye(self.vocab_size, dtype=dtype or np.float32)[self.tokens]


class StandInStage:
    """The `Stage` interface a stage process drives, with a timed wait for a forward."""

    def __init__(self, index: int, num_stages: int, mesh: Mesh, layers: tuple[int, int], latency: LatencyModel,
                 jitter: float, vocab_size: int, max_num_seqs: int, seed: int = 0) -> None:
        self.index = index
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.mesh, self.layers = mesh, layers
        self.latency, self.jitter = latency, jitter
        self.vocab_size, self.max_num_seqs = vocab_size, max_num_seqs
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.kv = None  # no KV cache: nothing to wait for or donate
        self.mla_rebuild_weight = None  # no MLA attention: the stand-in only waits
        self._rng = np.random.default_rng([seed, index])
        log.warning("stage %d is a STAND-IN DEVICE: no model runs; every forward waits t(L, x) with %s "
                    "(jitter %.3g); its tokens are not a model's (benchmarks and load tests only)",
                    index, latency.describe(), jitter)

    @property
    def devices(self) -> list[Any]:
        return list(self.mesh.devices.flat)

    def compile(self, shape: StepShape, num_tokens: int) -> None:
        pass  # nothing to compile

    def put(self, host: np.ndarray) -> jax.Array:
        return jax.device_put(host, self.replicated)

    def hidden_aval(self, num_tokens: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_tokens,), np.int32, sharding=self.replicated)

    def tokens_aval(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.max_num_seqs,), np.int32, sharding=self.replicated)

    def run(self, batch: StageInput, hidden: jax.Array | None, fed_back: jax.Array | None = None) -> Any:
        """Last t(L, x) of this micro-batch in all; hand on its (resolved) token ids, or tokens."""
        begun = time.perf_counter()
        step = unpack(np.asarray(batch.packed), batch.layout)
        if self.is_first:
            if fed_back is not None:
                step = with_fed_back_tokens(step, np.asarray(fed_back))
        else:
            step = dataclasses.replace(step, token_ids=np.asarray(hidden))  # what the first stage embedded
        out = self._output(step, batch)
        if int(step.num_seqs) > 0:  # an all-padding step is warm-up: nothing to model
            self._wait_until(begun, modelled_seconds(self.latency, step))
        return out

    def run_attention_free(self, batch: StageInput, hidden: jax.Array | None) -> Any:
        """The start-up sweep's forward: c + b·T in all, every token a padding token."""
        begun = time.perf_counter()
        step = unpack(np.asarray(batch.packed), batch.layout)
        out = self._output(step, batch)
        self._wait_until(begun, self.latency.c + self.latency.b * step.num_tokens_padded)
        return out

    def _wait_until(self, begun: float, seconds: float) -> None:
        """Return `seconds` (jittered) after `begun`: the stand-in's own bookkeeping (unpacking the
        step, making its tokens: 1-2.5 ms a forward on a 2-core machine) runs inside the modelled time,
        as a device's work runs inside its forward, so it does not add to every forward as a constant
        the calibration would have to find in c."""
        if self.jitter:
            seconds *= max(0.0, 1.0 + self.jitter * float(self._rng.standard_normal()))
        deadline = begun + seconds
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)

    def _output(self, step: Any, batch: StageInput) -> Any:
        if not self.is_last:
            return jax.device_put(step.token_ids, self.replicated)
        tokens = np.zeros(self.max_num_seqs, np.int32)
        tokens[: step.kv_lens.shape[0]] = fake_tokens(step) % self.vocab_size
        lp = FakeExecutor.one_hot_logprobs(tokens, tokens, self.vocab_size)
        arrays = (tokens, lp.logprobs, lp.top_ids, lp.top_logprobs)
        sampled = SampledTokens(*(jax.device_put(a, self.replicated) for a in arrays))
        return StepOutput(sampled, OneHotLogits(tokens, self.vocab_size), step, batch)  # type: ignore[arg-type]

    def run_prompt_logprobs(self, out: StepOutput) -> Any:
        """Every prompt token's log-probability under the fake's one-hot logits, as the fake executor has it."""
        step: Any = out.hidden  # the stand-in keeps the resolved step where a stage keeps its activations
        predicted = next_tokens(step) % self.vocab_size
        lp = FakeExecutor.one_hot_logprobs(predicted, step.prompt_targets, self.vocab_size)
        return lp.logprobs, lp.top_ids, lp.top_logprobs
