"""Automatic calibration of the latency model: the start-up sweep (b, c) and the runtime calibrator (a, γ, c).

How the pieces move:
1. start-up: `startup_sweep_sizes` picks up to 24 aligned chunk sizes; `run_startup_sweep` times an
   attention-free forward per size (one warm-up, then the best of two) through a callable the executor
   provides, and `fit_startup` (`fitting.py`) turns them into b, c. A forward that raises propagates:
   the other pipeline stages are already waiting on it, so start-up must fail.
2. runtime: the controller feeds `RuntimeCalibrator.record` one timing per sole-prefill batch. Timings
   are kept per (chunk, prefix) shape (at most 4 each, at most 512 shapes) and reduced by their median.
   Once there is enough spread it fits on every new sample; a fit that passes every check is the model,
   each rejection is counted, and the give-up rules end calibration with a reason.
No clock is read here: the caller measures, so the same code runs in the simulator and the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from jaxcpp.chunking.fitting import Rejection, fit_errors, fit_runtime, relative_rms
from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.planner import ChunkSettings, snap_down

MAX_SWEEP_SIZES = 24
MIN_SWEEP_SIZES = 8
MAX_TIMINGS_PER_SHAPE = 4
MAX_SHAPES = 512
MIN_SHAPES = 6
MIN_PREFIXES = 3
MIN_CHUNK_SIZES = 2
MIN_PREFIXES_PER_SIZE = 2  # a chunk size counts towards MIN_CHUNK_SIZES once sampled at this many prefixes
MAX_REJECTED_FITS = 8
MAX_REQUESTS_WITH_ONE_SIZE = 8
# Ours (the spec says "a long stretch"): scheduler steps without a new sample before timing stops.
MAX_STEPS_WITHOUT_SAMPLE = 20_000


@dataclass(frozen=True)
class SweepPlan:
    sizes: list[int]          # largest first; empty when there is no baseline
    reason: str | None = None  # why there is no baseline


def startup_sweep_sizes(settings: ChunkSettings, max_model_len: int | None = None) -> SweepPlan:
    """Up to 24 sizes spaced linearly from the largest chunk down to max(alignment, largest / 8)."""
    largest = snap_down(min(settings.budget, max_model_len or settings.budget), settings)
    smallest = snap_down(max(settings.alignment, largest / 8), settings)
    if largest < settings.alignment or smallest < 1:
        return SweepPlan([], f"the largest chunk ({largest}) is below the alignment {settings.alignment}")
    spaced = np.linspace(largest, smallest, MAX_SWEEP_SIZES)
    sizes = sorted({snap_down(float(v), settings) for v in spaced} - {0}, reverse=True)
    if len(sizes) < MIN_SWEEP_SIZES:
        return SweepPlan([], f"only {len(sizes)} distinct chunk sizes between {smallest} and {largest} "
                             f"(needs {MIN_SWEEP_SIZES}); raise --max-num-batched-tokens")
    return SweepPlan(sizes)


def run_startup_sweep(forward: Callable[[int], float], sizes: list[int]) -> list[float]:
    """Best of two timings per size after one warm-up forward at the largest size (at most 49 forwards).

    `forward(num_tokens)` runs one attention-free dummy forward and returns the seconds around the
    model call only; exceptions are not caught (see the module docstring).
    """
    forward(max(sizes))
    return [min(forward(size), forward(size)) for size in sizes]


@dataclass
class _Shape:
    timings: list[float]

    def median(self) -> float:
        return float(np.median(self.timings))


class RuntimeCalibrator:
    """Collects sole-prefill timings and fits a, γ, c with the start-up b; see the module docstring.

    `status` is "collecting", "accepted" (then `model` and `fit_error` are set) or "gave_up" (then
    `give_up_reason`). `fit_error` is the accepted fit's RMS residual over its shapes, as a share of their
    mean latency: how far the model may be trusted to rank plans; `gamma_zero_fit_error` the same for
    a fit of the same samples with γ forced to 0 (what the γ·L term buys: MLA's prefix rebuild);
    `last_fit_errors` both, for the last fit tried, accepted or not.
    """

    def __init__(self, budget: int, b: float | None = None, c_startup: float | None = None) -> None:
        self.budget = budget
        self.b = b
        self.c_startup = c_startup
        self.status = "collecting"
        self.model: LatencyModel | None = None
        self.fit_error = 0.0
        self.gamma_zero_fit_error = 0.0
        self.last_fit_errors: tuple[float, float] | None = None  # (with γ, γ forced to 0) of the last fit tried
        self.with_gamma = True  # False: γ held at 0 (MLA chunks attending absorbed: `DynamicChunkController`)
        self.give_up_reason: str | None = None
        self.rejections: list[str] = []
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._first_request: Hashable | None = None
        self._sampled_requests: set[Hashable] = set()
        self._new_sample = False
        self._steps_without_sample = 0

    def set_startup(self, b: float, c: float) -> None:
        self.b, self.c_startup = b, c

    def record(self, chunk: int, prefix: int, seconds: float, request_id: Hashable) -> None:
        """One timing of a batch that held exactly this one prefill chunk; may fit, accept or give up."""
        if self.status != "collecting":
            return
        if self._first_request is None:
            self._first_request = request_id  # warm-up effects: its timings are discarded
        if request_id == self._first_request:
            return
        self._steps_without_sample = 0
        self._sampled_requests.add(request_id)
        key = (int(chunk), int(prefix))
        shape = self._shapes.get(key)
        if shape is None and len(self._shapes) < MAX_SHAPES:
            self._shapes[key] = _Shape([float(seconds)])
            self._new_sample = True
        elif shape is not None and len(shape.timings) < MAX_TIMINGS_PER_SHAPE:
            shape.timings.append(float(seconds))
            self._new_sample = True
        self._check_sizes_spread()
        if self.status == "collecting":
            self.maybe_fit()

    def tick(self) -> None:
        """One scheduler step; a long stretch without a sample ends calibration."""
        if self.status != "collecting":
            return
        self._steps_without_sample += 1
        if self._steps_without_sample >= MAX_STEPS_WITHOUT_SAMPLE:
            self._give_up(f"no sole-prefill timing for {MAX_STEPS_WITHOUT_SAMPLE} scheduler steps")

    def readiness(self) -> str | None:
        """None when a fit may run, else why not yet."""
        if self.b is None or self.c_startup is None:
            return "no start-up fit of b and c yet"
        chunks = self._chunk_sizes_with_slope()
        prefixes = {p for _, p in self._shapes}
        if len(self._shapes) < MIN_SHAPES:
            return f"{len(self._shapes)} shapes sampled, needs {MIN_SHAPES}"
        if len(prefixes) < MIN_PREFIXES:
            return f"{len(prefixes)} distinct prefixes sampled, needs {MIN_PREFIXES}"
        if len(chunks) < MIN_CHUNK_SIZES:
            return (f"{len(chunks)} distinct chunk sizes sampled at {MIN_PREFIXES_PER_SIZE}+ prefixes, needs "
                    f"{MIN_CHUNK_SIZES}")
        if not self._new_sample:
            return "no new sample since the last fit"
        return None

    def maybe_fit(self) -> LatencyModel | Rejection | None:
        """Fit if ready; returns the accepted model, the rejection, or None when not ready."""
        if self.status != "collecting" or self.readiness() is not None:
            return None
        assert self.b is not None and self.c_startup is not None
        self._new_sample = False
        keys = list(self._shapes)
        chunks, prefixes = np.array([c for c, _ in keys]), np.array([p for _, p in keys])
        seconds = np.array([self._shapes[k].median() for k in keys])
        result = fit_runtime(chunks, prefixes, seconds, self.b, self.c_startup, self.budget, self.with_gamma)
        self.last_fit_errors = fit_errors(chunks, prefixes, seconds, self.b, self.c_startup)
        if isinstance(result, Rejection):
            self.rejections.append(result.reason)
            if len(self.rejections) >= MAX_REJECTED_FITS:
                self._give_up(f"{MAX_REJECTED_FITS} fits rejected, the last because {result.reason}")
            return result
        self.status, self.model = "accepted", result
        self.fit_error = relative_rms(seconds - result.predict(prefixes, chunks), seconds)
        self.gamma_zero_fit_error = self.last_fit_errors[1]
        return result

    @property
    def num_shapes(self) -> int:
        return len(self._shapes)

    def _chunk_sizes_with_slope(self) -> set[int]:
        """Chunk sizes sampled at MIN_PREFIXES_PER_SIZE prefixes or more. A prompt's last chunk (its
        remainder) is a new size nearly every prompt, each seen once: counted, it made "two sizes" of
        one base chunk, and a with γ then rested on that one sample (a real 4K-token fit installed
        a = 5.4e-9, γ = 8.3e-6 and predicted 55-76% short). Two sizes each seen along the prefix give
        two slopes in L, 2a·x + γ, which is what tells a from γ."""
        prefixes: dict[int, set[int]] = {}
        for chunk, prefix in self._shapes:
            prefixes.setdefault(chunk, set()).add(prefix)
        return {c for c, seen in prefixes.items() if len(seen) >= MIN_PREFIXES_PER_SIZE}

    def _check_sizes_spread(self) -> None:
        chunks = self._chunk_sizes_with_slope()
        if len(self._sampled_requests) >= MAX_REQUESTS_WITH_ONE_SIZE and len(chunks) < MIN_CHUNK_SIZES:
            self._give_up(f"{len(self._sampled_requests)} sampled requests gave fewer than "
                          f"{MIN_CHUNK_SIZES} chunk sizes")

    def _give_up(self, reason: str) -> None:
        self.status, self.give_up_reason = "gave_up", reason
