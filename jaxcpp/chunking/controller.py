"""The scheduler's one handle on dynamic chunking: state machine, gate, calibration and policy together.

Contract (the scheduler calls, in this order each step):
- `observe_step(num_prefill_sources)`: once per step, before sizing, with the number of requests that
  could prefill now (running partial prefills + waiting requests that can prefill).
- `chunk_size_for(request_id, prompt_len, num_computed_tokens, budget_left, step_tokens=0) -> int`: the
  chunk to schedule for that request, never more than `budget_left` (what is left of this step's token
  budget) or the rest of the prompt; pass `single_forward=True` for a prefill that must go in one
  forward. `num_computed_tokens` is the prefix L the chunk starts after, a cached prefix included: the
  policies plan from it (equal-latency's prefix, optimal's plan `start`); `prefill_start` is where
  this admission began (its cached prefix), so a cache hit still counts as a newly admitted prompt. A
  chunk it sizes on purpose is cut so that the whole step (`step_tokens` already in it, e.g. decodes,
  plus the chunk) is a compiled bucket: such a chunk is never padded.
- `record_timing(num_tokens, prefix, seconds, batch_is_sole_prefill, request_id)`: when a batch's
  forward time is known (the model call only; `num_tokens` is the padded size that ran); ignored
  unless calibrating.
- `finish_request(request_id)`: forget per-request state.
`prefill_chunk(seq, budget_left, step_tokens)` and `observe_step` make it a `jaxcpp.core.chunk_sizer.ChunkSizer`.
Start-up: `startup_sweep_sizes()` then `run_startup_sweep(forward)` (or `set_startup_fit(b, c)`).
Reporting: `stats()` (state, policy, coefficients, fit error), `report()` (the periodic log line; `report_counts()`
returns and resets its counters). `needs_ack` tells the PP head to wait for the last stage's
acknowledgement of middle prefill chunks.

States (`ChunkingState`): off (disabled or not applicable), calibrating, installed, gave_up. Off and gave_up keep
fixed chunking for good; calibrating gives each newly admitted sole prefill a base chunk alternating
between the budget and max(budget / 4, min chunk), kept for the whole prompt; installed sizes chunks
with the policy ("equal-latency" per step, "optimal" planned at admission and replanned once when the
load becomes sustained, i.e. a prompt comes while another prefills (`jaxcpp.chunking.load`), "fixed").
"optimal" runs the middle one of the fixed chunks predicted within the installed fit's error of its best
plan, where there are any.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from jaxcpp.chunking.calibration import (
    MAX_REJECTED_FITS,
    RuntimeCalibrator,
    run_startup_sweep,
    startup_sweep_sizes,
)
from jaxcpp.chunking.fitting import Rejection, fit_startup
from jaxcpp.chunking.gate import SolePrefillGate
from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.load import PrefillLoad
from jaxcpp.chunking.mla_cost import MlaShape, planned_form
from jaxcpp.chunking.optimal import plan_optimal
from jaxcpp.chunking.planner import (
    ChunkSettings,
    equal_latency_chunk,
    fit_budget,
    settings_from_config,
    snap_down,
)
from jaxcpp.chunking.policy import check_policy

if TYPE_CHECKING:
    from jaxcpp.config import EngineConfig

logger = logging.getLogger("jaxcpp.chunking")
COUNTERS = ("model", "calibration", "fixed_unreachable", "fixed_concurrent")


class ChunkingState(enum.StrEnum):
    OFF = "off"
    CALIBRATING = "calibrating"
    INSTALLED = "installed"
    GAVE_UP = "gave_up"


def format_report(counts: dict[str, int]) -> str:
    return ("Dynamic chunking since last report: "
            f"{counts['model']} chunks sized from the model, {counts['calibration']} by the calibration "
            f"sweep, fixed budget kept for {counts['fixed_unreachable']} (no equal-latency chunk reachable) "
            f"and {counts['fixed_concurrent']} (other prefills present)")


class DynamicChunkController:
    """See the module docstring for the call contract."""

    def __init__(self, settings: ChunkSettings, *, policy: str = "equal-latency", enabled: bool = True,
                 model: LatencyModel | None = None, max_model_len: int | None = None,
                 runs_prefills: bool = True) -> None:
        check_policy(policy)
        self.settings = settings
        self.policy = policy
        self.max_model_len = max_model_len
        self.model: LatencyModel | None = None
        self.fit_error = 0.0
        self.gamma_zero_fit_error: float | None = None
        self.prefill_form: str | None = None  # MLA: "absorbed", "rebuilt" or "mixed" (`set_prefill_form`)
        self.gate = SolePrefillGate()
        self._num_prefill_sources = 1  # this step's, as last observed
        self.load = PrefillLoad()       # optimal: whether prompts keep arriving while others prefill
        self.calibrator = RuntimeCalibrator(settings.budget)
        self.quarter_base = snap_down(max(settings.budget // 4, settings.min_chunk_size), settings)
        self._bases: dict[Hashable, int] = {}      # calibrating: the base chunk kept for a whole prompt
        self._plans: dict[Hashable, dict[int, int]] = {}  # optimal: planned chunk by its start
        self._admitted = 0
        self._planned_this_step = False  # optimal: a prompt already took this step's planned chunk
        self._rejections_logged = 0
        self._counts = dict.fromkeys(COUNTERS, 0)
        self.state = ChunkingState.CALIBRATING if enabled else ChunkingState.OFF
        if enabled:
            self._check_applicable(runs_prefills)
        if model is not None and self.state != ChunkingState.OFF:
            self.install(model)

    @classmethod
    def from_config(cls, config: EngineConfig, allowed_sizes: tuple[int, ...] | None = None,
                    runs_prefills: bool = True, max_model_len: int | None = None) -> DynamicChunkController:
        """Built from the engine config; `allowed_sizes` are the compiled token buckets, `max_model_len`
        the resolved one when --max-model-len was left to the model.

        With an uneven --pp-partition the stages weigh layers / the largest stage's layers: the model
        describes the slowest stage, so the engine should time that one.
        """
        chunking = config.chunking
        settings = settings_from_config(config, allowed_sizes)
        return cls(settings, policy=chunking.dynamic_chunking_policy,
                   enabled=chunking.enable_dynamic_chunking, max_model_len=max_model_len or config.model.max_model_len,
                   runs_prefills=runs_prefills)

    # ----- start-up ---------------------------------------------------------------------------------
    def startup_sweep_sizes(self) -> list[int]:
        """Chunk sizes for the attention-free sweep; empty (and gave up, logged) when there is no baseline."""
        if self.state != ChunkingState.CALIBRATING:
            return []
        plan = startup_sweep_sizes(self.settings, self.max_model_len)
        if not plan.sizes:
            self._give_up(f"no start-up baseline: {plan.reason}")
        return plan.sizes

    def run_startup_sweep(self, forward: Callable[[int], float]) -> None:
        """Time `forward(num_tokens)` over the sweep sizes and fit b, c (exceptions propagate)."""
        sizes = self.startup_sweep_sizes()
        if not sizes:
            return
        fit = fit_startup(sizes, run_startup_sweep(forward, sizes))
        if isinstance(fit, Rejection):
            self._give_up(fit.reason)
            return
        self.set_startup_fit(*fit)

    def plan_mla_prefill(self, shape: MlaShape, rebuild_weight: float) -> None:
        """An MLA model's stages attend prefill chunks by `rebuild_weight`'s rule: calibrate the latency
        model of the form the chunks this controller plans will take (`set_prefill_form`)."""
        if self.state == ChunkingState.CALIBRATING:
            self.set_prefill_form(planned_form(shape, rebuild_weight, (self.quarter_base, self.settings.budget)))

    def set_prefill_form(self, form: str) -> None:
        """An MLA model's: how the chunks it plans attend (`jaxcpp.chunking.mla_cost.planned_form`):
        "absorbed" rebuilds no prefix, so calibration holds γ at 0; "rebuilt" / "mixed" fit it."""
        self.prefill_form = form
        self.calibrator.with_gamma = form != "absorbed"
        logger.info("Dynamic chunking: MLA prefill chunks of %d-%d tokens attend %s, so calibration %s",
                    self.quarter_base, self.settings.budget, form,
                    "holds gamma at 0" if form == "absorbed" else "fits gamma (the prefix rebuild)")

    def set_startup_fit(self, b: float, c: float) -> None:
        logger.info("Dynamic chunking start-up fit: b=%.6g c=%.6g", b, c)
        self.calibrator.set_startup(b, c)

    # ----- per step ---------------------------------------------------------------------------------
    def observe_step(self, num_prefill_sources: int) -> None:
        self.gate.observe(num_prefill_sources)
        self._num_prefill_sources = num_prefill_sources
        if self.load.observe(num_prefill_sources):
            # The prompt prefilling now was planned as one of a batch; its rest is replanned as one of a
            # stream (the prompts behind it will wait again and again, not once).
            self._plans.clear()
        self._planned_this_step = False
        if self.state == ChunkingState.CALIBRATING:
            self.calibrator.tick()
            self._after_calibration()

    def chunk_size_for(self, request_id: Hashable, prompt_len: int, num_computed_tokens: int, budget_left: int,
                       *, single_forward: bool = False, step_tokens: int = 0, prefill_start: int = 0) -> int:
        chunk = self._chunk_size(request_id, prompt_len, num_computed_tokens, budget_left, single_forward,
                                 step_tokens, prefill_start)
        if 0 < prompt_len - num_computed_tokens <= chunk:
            self.load.prefill_ended()
        return chunk

    def _chunk_size(self, request_id: Hashable, prompt_len: int, num_computed_tokens: int, budget_left: int,
                    single_forward: bool, step_tokens: int, prefill_start: int) -> int:
        remaining = prompt_len - num_computed_tokens
        fixed = max(min(self.settings.budget, budget_left, remaining), 0)
        if self.state in (ChunkingState.OFF, ChunkingState.GAVE_UP) or remaining <= 0 or single_forward:
            return fixed
        if self.state == ChunkingState.INSTALLED and self.policy == "optimal":
            return self._queued_plan_chunk(request_id, prompt_len, num_computed_tokens, budget_left, fixed,
                                           step_tokens)
        if not self.gate.is_open:
            self._counts["fixed_concurrent"] += 1
            return fixed
        if self.state == ChunkingState.CALIBRATING:
            self._counts["calibration"] += 1
            chunk = min(self._base_for(request_id, num_computed_tokens == prefill_start), budget_left, remaining)
        else:
            chunk = self._model_chunk(request_id, prompt_len, num_computed_tokens, budget_left, fixed)
        return self._unpadded(chunk, remaining, step_tokens)

    def prefill_chunk(self, seq: Any, budget_left: int, step_tokens: int = 0) -> int:
        """The `jaxcpp.core.chunk_sizer.ChunkSizer` form: seq has request_id, num_computed_tokens, num_remaining
        and (a `jaxcpp.core.sequence.Sequence`) admission_prefix, the cached prefix it was admitted with."""
        done = seq.num_computed_tokens
        return self.chunk_size_for(seq.request_id, done + seq.num_remaining, done, budget_left,
                                   step_tokens=step_tokens, prefill_start=getattr(seq, "admission_prefix", 0))

    def record_timing(self, num_tokens: int, prefix: int, seconds: float, batch_is_sole_prefill: bool,
                      request_id: Hashable) -> None:
        if self.state != ChunkingState.CALIBRATING or not batch_is_sole_prefill:
            return
        self.calibrator.record(num_tokens, prefix, seconds, request_id)
        self._after_calibration()

    def finish_request(self, request_id: Hashable) -> None:
        self._bases.pop(request_id, None)
        self._plans.pop(request_id, None)

    # ----- state ------------------------------------------------------------------------------------
    def install(self, model: LatencyModel, fit_error: float = 0.0, gamma_zero_fit_error: float | None = None) -> None:
        """`fit_error`: the model's RMS residual over its calibration samples, as a share of their mean
        latency (0 for a model taken as exact); `optimal` runs the middle one of the fixed chunks predicted
        within it of its best plan, where there are any. `gamma_zero_fit_error`: the same samples fitted
        with γ forced to 0 (calibration computes it; shown beside, in the log line and stats)."""
        self.model, self.fit_error, self.state = model, fit_error, ChunkingState.INSTALLED
        self.gamma_zero_fit_error = gamma_zero_fit_error
        self._bases.clear()
        logger.info("Dynamic chunking latency model installed: %s", self.describe_model())

    def describe_model(self) -> str | None:
        """`a=… b=… c=… gamma=… (fit error …%[; gamma forced to 0: …%])`, or None before a model is installed."""
        if self.model is None:
            return None
        beside = "" if self.gamma_zero_fit_error is None else f"; gamma forced to 0: {self.gamma_zero_fit_error:.2%}"
        return f"{self.model.describe()} (fit error {self.fit_error:.2%}{beside})"

    @property
    def needs_ack(self) -> bool:
        """The PP head waits for the last stage to acknowledge middle prefill chunks in these states."""
        return self.state in (ChunkingState.CALIBRATING, ChunkingState.INSTALLED)

    def stats(self) -> dict[str, Any]:
        """State, policy and (once installed) the latency model's coefficients, for stats and metrics."""
        coeffs = {} if self.model is None else {**dataclasses.asdict(self.model), "fit_error": self.fit_error}
        if self.model is not None and self.gamma_zero_fit_error is not None:
            coeffs["fit_error_gamma0"] = self.gamma_zero_fit_error
        return {"state": self.state.value, "policy": self.policy, **coeffs}

    def report(self) -> str:
        return format_report(self.report_counts())

    def report_counts(self) -> dict[str, int]:
        counts, self._counts = self._counts, dict.fromkeys(COUNTERS, 0)
        return counts

    # ----- internals --------------------------------------------------------------------------------
    def _check_applicable(self, runs_prefills: bool) -> None:
        s = self.settings
        if not runs_prefills:
            self._turn_off("this instance runs no prefills (decode-only)")
        elif s.pipeline_parallel_size <= 1:
            self._turn_off("needs --pipeline-parallel-size > 1")
        elif s.min_chunk_size >= s.budget or self.quarter_base >= snap_down(s.budget, s):
            self._turn_off(f"--dynamic-chunking-min-chunk-size ({s.min_chunk_size}) must be below "
                           f"--max-num-batched-tokens ({s.budget}), or the two calibration chunk sizes "
                           "collapse into one")

    def _turn_off(self, why: str) -> None:
        logger.warning("Dynamic chunking turned off: %s; keeping fixed chunking", why)
        self.state = ChunkingState.OFF

    def _give_up(self, why: str) -> None:
        logger.warning("Dynamic chunking calibration gave up: %s; keeping fixed chunking", why)
        self.state = ChunkingState.GAVE_UP
        self._bases.clear()

    def _after_calibration(self) -> None:
        for reason in self.calibrator.rejections[self._rejections_logged:]:
            self._rejections_logged += 1
            logger.info("Dynamic chunking fit rejected (%d/%d): %s", self._rejections_logged,
                        MAX_REJECTED_FITS, reason)
        status = self.calibrator.status
        if status == "accepted" and self.calibrator.model is not None:
            self.install(self.calibrator.model, self.calibrator.fit_error, self.calibrator.gamma_zero_fit_error)
        elif status == "gave_up":
            self._give_up(self.calibrator.give_up_reason or "calibration failed")

    def _base_for(self, request_id: Hashable, at_admission: bool) -> int:
        base = self._bases.get(request_id)
        if base is None:
            # Only a newly admitted prompt alternates (its first chunk, after any cached prefix); one
            # met mid-prompt keeps the budget.
            quarter = at_admission and self._admitted % 2 == 1
            base = self.quarter_base if quarter else self.settings.budget
            self._admitted += at_admission
            self._bases[request_id] = base
        return base

    def _unpadded(self, chunk: int, remaining: int, step_tokens: int) -> int:
        """A chunk sized on purpose, cut so that the step it joins (`step_tokens` + chunk) is exactly a
        bucket: with decodes in the step, a bucket-sized chunk would otherwise run the next bucket up.
        The prompt's last chunk (the remainder) is left whole: cutting it would only add a step."""
        if step_tokens == 0 or chunk >= remaining:
            return chunk
        step = snap_down(step_tokens + chunk, self.settings)
        return step - step_tokens if step > step_tokens else chunk

    def _queued_plan_chunk(self, request_id: Hashable, prompt_len: int, done: int, budget_left: int, fixed: int,
                           step_tokens: int) -> int:
        """`optimal` with other prefills queued too: long prompts go one at a time, each in the chunks of
        its own plan (the first asked in a step, the oldest, takes it); a later prompt joins the step only
        if it fits whole in what is left of the budget, else it waits for its turn. Cutting several long
        prompts at the fixed budget at once (ATOM's rule under concurrency) makes every chunk after the
        first wait behind the slowest; planned one at a time, each prompt's chunks stay equal in time."""
        if self._planned_this_step:
            return fixed if fixed == prompt_len - done else 0
        self._planned_this_step = True
        chunk = self._model_chunk(request_id, prompt_len, done, budget_left, fixed)
        return self._unpadded(chunk, prompt_len - done, step_tokens)

    def _model_chunk(self, request_id: Hashable, prompt_len: int, done: int, budget: int, fixed: int) -> int:
        assert self.model is not None
        if self.policy == "fixed":
            return fixed
        if self.policy == "equal-latency":
            choice = equal_latency_chunk(self.model, done, budget, self.settings)
            self._counts["model" if choice.source == "model" else "fixed_unreachable"] += 1
            return min(choice.size, prompt_len - done)
        plan = self._plans.get(request_id)
        if plan is None or done not in plan:  # new prompt, the budget cut a planned chunk, or the load changed
            queued = max(self._num_prefill_sources - 1, 0)
            chunks = plan_optimal(self.model, prompt_len, self.settings, start=done,
                                  queued=self.load.waiting_for(queued), sustained=self.load.sustained,
                                  margin=self.fit_error)
            starts = [done + sum(chunks[:i]) for i in range(len(chunks))]
            plan = self._plans[request_id] = dict(zip(starts, chunks, strict=True))
        self._counts["model"] += 1
        return fit_budget(plan[done], budget, prompt_len - done, self.settings)
