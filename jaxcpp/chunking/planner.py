"""Chunk sizing: the per-step equal-latency solver (ATOM's rule) and fixed chunks.

How the pieces move: `equal_latency_chunk` is the chunk of the sole prefilling request at one step;
`plan_equal_latency` replays it until the prompt is done. The `optimal` policy plans the whole prompt at
once in `optimal.py`; `policy.py` is the one entry point over all three policies (the CLI, the simulator
and the tests use it). The scheduler's controller (`controller.py`) calls `equal_latency_chunk` itself,
to count where each chunk came from, and caches `optimal` plans.

Every chunk the solver picks is snapped DOWN to an allowed size: the largest compiled token bucket not
above it when the engine passes its buckets, else a multiple of the alignment max(page_size, 64)
(`jaxcpp.core.buckets.token_alignment`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.config import DEFAULT_SMOOTH_FACTOR, EngineConfig
from jaxcpp.core.buckets import token_alignment
from jaxcpp.core.in_flight import PREFILL_DEPTH_FACTOR

POLICIES = ("fixed", "equal-latency", "optimal")
# A chunk whose γ·L prefix rebuild would exceed this share of its own latency is too small to pay off.
MAX_PREFIX_SHARE = 0.2


@dataclass(frozen=True)
class ChunkSettings:
    """What the solver needs besides the model; one per engine, built from the config."""

    budget: int                            # --max-num-batched-tokens: first, reference and largest chunk
    smooth_factor: float = DEFAULT_SMOOTH_FACTOR  # 0 = fixed chunks, 1 = the solved equal-latency chunk
    min_chunk_size: int = 4096
    page_size: int = 16
    pipeline_parallel_size: int = 1
    allowed_sizes: tuple[int, ...] | None = None   # compiled token buckets, ascending
    stage_weights: tuple[float, ...] | None = None  # per-stage time relative to the model, for uneven PP
    in_flight_depth: int | None = None  # the engine's steps in flight (P, + 1 with async scheduling); None: P

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if not 0.0 <= self.smooth_factor <= 1.0:
            raise ValueError(f"smooth factor must be in [0, 1], got {self.smooth_factor}")
        sizes = self.allowed_sizes
        if sizes is not None and (not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes))):
            raise ValueError(f"allowed sizes must be positive and strictly ascending, got {sizes}")
        if self.stage_weights is not None and len(self.stage_weights) != self.pipeline_parallel_size:
            raise ValueError(f"{len(self.stage_weights)} stage weights for "
                             f"{self.pipeline_parallel_size} pipeline stages")
        if self.in_flight_depth is not None and self.in_flight_depth < 1:
            raise ValueError(f"in_flight_depth must be >= 1, got {self.in_flight_depth}")

    @property
    def alignment(self) -> int:
        return token_alignment(self.page_size)

    @property
    def max_prompt_steps_in_flight(self) -> int:
        """Steps of prompt chunks the engine keeps in flight at most (`jaxcpp.core.in_flight`)."""
        return PREFILL_DEPTH_FACTOR * (self.in_flight_depth or self.pipeline_parallel_size)


def stage_weights_from_layers(layers: list[int]) -> tuple[float, ...]:
    """Per-stage weights for an uneven --pp-partition: layers / the largest stage's layers.

    The latency model describes the slowest stage, so that stage weighs 1.
    """
    return tuple(n / max(layers) for n in layers)


def settings_from_config(config: EngineConfig, allowed_sizes: tuple[int, ...] | None = None) -> ChunkSettings:
    """The settings the engine's flags imply; `allowed_sizes` are the compiled token buckets, if known.

    With an uneven --pp-partition the stages weigh layers / the largest stage's layers. The in-flight
    depth is the engine's: P, and one more with async scheduling.
    """
    parallel, chunking = config.parallel, config.chunking
    weights = stage_weights_from_layers(parallel.partition_list()) if parallel.pp_partition is not None else None
    return ChunkSettings(budget=config.scheduler.max_num_batched_tokens,
                         smooth_factor=chunking.dynamic_chunking_smooth_factor,
                         min_chunk_size=chunking.dynamic_chunking_min_chunk_size,
                         page_size=config.cache.page_size,
                         pipeline_parallel_size=parallel.pipeline_parallel_size,
                         allowed_sizes=allowed_sizes, stage_weights=weights,
                         in_flight_depth=parallel.pipeline_parallel_size + config.scheduler.async_scheduling)


def snap_down(value: float, settings: ChunkSettings) -> int:
    """The largest allowed chunk size <= value, or 0 when there is none."""
    # Rounding slack: the root at L = 0 is the base itself, computed as 32767.999999999996 or so.
    tokens = math.floor(value + 1e-6)
    if tokens < 1:
        return 0
    if settings.allowed_sizes is not None:
        i = bisect.bisect_right(settings.allowed_sizes, tokens)
        return settings.allowed_sizes[i - 1] if i else 0
    return tokens // settings.alignment * settings.alignment


def positive_root(qa: float, qb: float, qc: float) -> float:
    """The larger root of qa·x² + qb·x + qc = 0 (qa >= 0), in the cancellation-free form; nan if none."""
    if qa <= 0.0:
        return -qc / qb if qb > 0.0 else math.nan
    disc = qb * qb - 4.0 * qa * qc
    if disc < 0.0:
        return math.nan
    root = math.sqrt(disc)
    # For qb > 0 the textbook (-qb + root) / 2qa loses digits when qc is small; 2qc / (-qb - root) does not.
    return (-2.0 * qc) / (qb + root) if qb > 0.0 else (-qb + root) / (2.0 * qa)


def raw_equal_latency_chunk(model: LatencyModel, prefix_len: int, base: int) -> float:
    """The x with t(L, x) = t(0, base), before smoothing and clamps; nan when none is reachable.

    target = a·base² + b·base − γ·L (c cancels; γ·L is a floor every chunk pays); x solves
    a·x² + (2·a·L + b)·x − target = 0.
    """
    target = model.a * base * base + model.b * base - model.gamma * prefix_len
    if target <= 0.0:
        return math.nan
    return positive_root(model.a, 2.0 * model.a * prefix_len + model.b, -target)


def prefix_floor(model: LatencyModel, prefix_len: int) -> float:
    """The smallest x for which γ·L is at most MAX_PREFIX_SHARE of t(L, x) (0 when any x is fine)."""
    overhang = model.gamma * prefix_len / MAX_PREFIX_SHARE - model.gamma * prefix_len - model.c
    if overhang <= 0.0:
        return 0.0
    root = positive_root(model.a, 2.0 * model.a * prefix_len + model.b, -overhang)
    return 0.0 if math.isnan(root) else root


@dataclass(frozen=True)
class ChunkChoice:
    size: int
    source: str  # "model": sized by the solver; "unreachable": kept the fixed chunk


def equal_latency_chunk(model: LatencyModel, prefix_len: int, budget: int,
                        settings: ChunkSettings) -> ChunkChoice:
    """One step of ATOM's rule: the chunk after `prefix_len` tokens that takes as long as the first.

    `budget` is what is left of this step's token budget; the base (first chunk) is `settings.budget`.
    Unreachable equal latency, or a chunk that aligns to nothing, keeps the fixed chunk.
    """
    base = settings.budget
    fixed = ChunkChoice(min(base, budget), "unreachable")
    raw = raw_equal_latency_chunk(model, prefix_len, base)
    if math.isnan(raw):
        return fixed
    smoothed = base + settings.smooth_factor * (raw - base)
    lower = max(settings.alignment, settings.min_chunk_size, prefix_floor(model, prefix_len))
    size = snap_down(min(max(smoothed, lower), base, budget), settings)
    if size < settings.alignment:
        return fixed
    return ChunkChoice(size, "model")


def fit_budget(chunk: int, budget: int, remaining: int, settings: ChunkSettings) -> int:
    """A planned chunk cut to what is left of this step's budget: snapped down, else the fixed chunk."""
    if chunk <= budget:
        return min(chunk, remaining)
    snapped = snap_down(budget, settings)
    return min(snapped if snapped >= settings.alignment else budget, remaining)


def plan_fixed(prompt_len: int, chunk: int, start: int = 0) -> list[int]:
    """Fixed chunking: `chunk` tokens at a time, the remainder last."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    full, rest = divmod(prompt_len - start, chunk)
    return [chunk] * full + ([rest] if rest else [])


def plan_equal_latency(prompt_len: int, settings: ChunkSettings, model: LatencyModel, start: int = 0) -> list[int]:
    """ATOM's rule replayed over one prompt prefilled alone with the full budget each step."""
    chunks: list[int] = []
    done = start
    while done < prompt_len:
        chunk = min(equal_latency_chunk(model, done, settings.budget, settings).size, prompt_len - done)
        chunks.append(chunk)
        done += chunk
    return chunks


def chunk_sizes_between(low: int, high: int, settings: ChunkSettings) -> list[int]:
    """Allowed chunk sizes in [low, high], ascending (buckets, or multiples of the alignment)."""
    if settings.allowed_sizes is not None:
        return [s for s in settings.allowed_sizes if low <= s <= high]
    step = settings.alignment
    first = max(step, -(-low // step) * step)
    return list(range(first, high + 1, step))
