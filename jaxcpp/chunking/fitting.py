"""Least-squares fits of the latency model and the checks a runtime fit must pass to be installed.

How the pieces move: the start-up sweep (`calibration.py`) hands `fit_startup` one best-of-two time
per attention-free chunk size and gets b, c. The runtime calibrator hands `fit_runtime` one median time
per (chunk, prefix) shape plus that b and c, and gets either a `LatencyModel` or a `Rejection` whose
`reason` a log line prints. Nothing here keeps state.

Runtime fit: (measured − b·x) on the columns [2·L·x + x², L, 1], each scaled to unit norm so that the
condition number measures the sampling grid, not the units. If c < 0 it is refitted with c pinned to
the start-up c; if then γ < 0, without the L column. Checks, in order, the first failure rejecting:
attention growth above noise, RMS residual, conditioning, prediction standard error, useful shrink.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from jaxcpp.chunking.latency_model import LatencyModel, attention_area
from jaxcpp.chunking.planner import raw_equal_latency_chunk

# Acceptance thresholds (docs/dynamic_chunking.md, "Calibration").
MAX_RMS_RESIDUAL = 0.25          # of the mean latency
MAX_CONDITION_NUMBER = 100.0     # of the column-scaled design
MAX_PREDICTION_SE = 0.05         # largest standard error of a fitted shape, of the mean latency
MAX_USEFUL_RAW_CHUNK = 0.95      # raw chunk one budget into a prompt, of the budget
# Ours: the attention term must move the latency across the samples by this many times the noise,
# where noise is the RMS residual but never below NOISE_FLOOR of the mean (timer jitter we never trust).
GROWTH_OVER_NOISE = 3.0
NOISE_FLOOR = 0.01


@dataclass(frozen=True)
class Rejection:
    """Why a fit was not accepted, in words for the log."""

    reason: str


def fit_startup(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float] | Rejection:
    """b, c from attention-free forwards: least squares of t = c + b·x; b <= 0 rejects, c is clamped at 0."""
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return Rejection(f"start-up fit needs two distinct chunk sizes, got {sorted(set(x.tolist()))}")
    slope, intercept = np.polyfit(x, t, 1)
    if not slope > 0:
        return Rejection(f"start-up fit gave b={slope:.4g} <= 0: time does not grow with chunk size")
    return float(slope), max(float(intercept), 0.0)


@dataclass(frozen=True)
class _Solve:
    model: LatencyModel
    design: np.ndarray  # column-scaled design of the free coefficients, [num_shapes, num_free]


def _solve(q: np.ndarray, prefix: np.ndarray, y: np.ndarray, b: float, c_pinned: float | None,
           with_gamma: bool) -> _Solve:
    """Least squares of y on the free columns among [q, L, 1], with columns scaled to unit norm."""
    columns = [q] + ([prefix] if with_gamma else []) + ([np.ones_like(q)] if c_pinned is None else [])
    raw = np.stack(columns, axis=1)
    norms = np.linalg.norm(raw, axis=0)
    norms[norms == 0] = 1.0
    design = raw / norms
    target = y - (c_pinned or 0.0)
    coef = np.linalg.lstsq(design, target, rcond=None)[0] / norms
    a = float(coef[0])
    gamma = float(coef[1]) if with_gamma else 0.0
    c = float(coef[-1]) if c_pinned is None else c_pinned
    return _Solve(LatencyModel(a=a, b=b, c=c, gamma=gamma), design)


def _fit_with_refits(chunk: np.ndarray, prefix: np.ndarray, seconds: np.ndarray, b: float,
                     c_startup: float, with_gamma: bool = True) -> _Solve:
    q = attention_area(prefix, chunk)
    y = seconds - b * chunk
    c_pinned: float | None = None
    fit = _solve(q, prefix, y, b, c_pinned, with_gamma)
    if fit.model.c < 0:  # a negative per-forward overhead is the fit trading c against γ or a
        c_pinned = c_startup
        fit = _solve(q, prefix, y, b, c_pinned, with_gamma)
    if with_gamma and fit.model.gamma < 0:  # a prefix that makes chunks faster is noise: drop the column
        with_gamma = False
        fit = _solve(q, prefix, y, b, c_pinned, with_gamma)
        if fit.model.c < 0:
            fit = _solve(q, prefix, y, b, c_startup, with_gamma)
    return fit


def _prediction_standard_errors(design: np.ndarray, residual: np.ndarray) -> np.ndarray | None:
    """Standard error of the fitted value at each shape, sqrt(σ²·h_ii); None without degrees of freedom."""
    dof = design.shape[0] - design.shape[1]
    if dof <= 0:
        return None
    sigma2 = float(residual @ residual) / dof
    leverage = np.einsum("ij,ij->i", design @ np.linalg.pinv(design.T @ design), design)
    return np.sqrt(sigma2 * np.maximum(leverage, 0.0))


def relative_rms(residual: np.ndarray, seconds: np.ndarray) -> float:
    """The RMS of a fit's residuals over its samples, as a share of their mean latency: the fit error."""
    return float(np.sqrt(np.mean(residual * residual)) / seconds.mean())


def check_fit(fit: _Solve, chunk: np.ndarray, prefix: np.ndarray, seconds: np.ndarray,
              budget: int) -> Rejection | None:
    """The acceptance checks in order; the first that fails names itself."""
    model = fit.model
    mean = float(seconds.mean())
    residual = seconds - model.predict(prefix, chunk)
    rms = relative_rms(residual, seconds) * mean
    q = attention_area(prefix, chunk)
    growth = model.a * float(q.max() - q.min())
    noise = max(rms, NOISE_FLOOR * mean)
    if not (model.a > 0 and growth > GROWTH_OVER_NOISE * noise):
        return Rejection(f"attention term shows no growth above noise: a={model.a:.3g} moves latency by "
                         f"{growth:.3g} across the samples, noise {noise:.3g}")
    if rms > MAX_RMS_RESIDUAL * mean:
        return Rejection(f"RMS residual {rms / mean:.1%} of mean latency > {MAX_RMS_RESIDUAL:.0%}")
    condition = float(np.linalg.cond(fit.design))
    if not condition <= MAX_CONDITION_NUMBER:
        return Rejection(f"ill-conditioned samples: condition number {condition:.3g} > "
                         f"{MAX_CONDITION_NUMBER:.0f}")
    errors = _prediction_standard_errors(fit.design, residual)
    if errors is None:
        return Rejection("no degrees of freedom left to estimate prediction uncertainty")
    worst = float(errors.max())
    if worst > MAX_PREDICTION_SE * mean:
        return Rejection(f"largest prediction standard error {worst / mean:.1%} of mean latency > "
                         f"{MAX_PREDICTION_SE:.0%}")
    raw = raw_equal_latency_chunk(model, budget, budget)
    if math.isnan(raw) or raw > MAX_USEFUL_RAW_CHUNK * budget:
        shown = "unreachable" if math.isnan(raw) else f"{raw / budget:.1%} of the budget"
        return Rejection(f"no useful shrink: the equal-latency chunk one budget into a prompt is {shown} "
                         f"(needs <= {MAX_USEFUL_RAW_CHUNK:.0%})")
    return None


def fit_runtime(chunks: ArrayLike, prefixes: ArrayLike, seconds: ArrayLike, b: float,
                c_startup: float, budget: int, with_gamma: bool = True) -> LatencyModel | Rejection:
    """a, γ, c with b fixed, from one (median) latency per shape; a model only if every check passes.
    `with_gamma=False`: γ held at 0 (an MLA model whose chunks attend absorbed rebuilds nothing)."""
    x = np.asarray(chunks, dtype=np.float64)
    prefix = np.asarray(prefixes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    fit = _fit_with_refits(x, prefix, t, b, c_startup, with_gamma)
    rejection = check_fit(fit, x, prefix, t, budget)
    return rejection if rejection is not None else fit.model


def fit_errors(chunks: ArrayLike, prefixes: ArrayLike, seconds: ArrayLike, b: float,
               c_startup: float) -> tuple[float, float]:
    """The fit errors (`relative_rms`) of the runtime fit with γ and with γ forced to 0, on the same
    samples: what the γ·L term buys. Same route as `fit_runtime` (b from the start-up sweep, c pinned
    if negative, a negative γ dropped), no acceptance checks; the calibrator keeps them for every fit
    it tries and reports them beside the installed model."""
    x = np.asarray(chunks, dtype=np.float64)
    prefix = np.asarray(prefixes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    errors = []
    for with_gamma in (True, False):
        model = _fit_with_refits(x, prefix, t, b, c_startup, with_gamma).model
        errors.append(relative_rms(t - model.predict(prefix, x), t))
    return errors[0], errors[1]


@dataclass(frozen=True)
class FreeFit:
    """All four coefficients fitted at once (an offline measurement, not the engine's calibration)."""

    model: LatencyModel
    errors: LatencyModel  # the standard error of each coefficient (0 for one held at 0)
    fit_error: float      # RMS residual as a share of the mean latency (`relative_rms`)


def fit_free(chunks: Sequence[int], prefixes: Sequence[int], seconds: Sequence[float],
             with_gamma: bool = True) -> FreeFit:
    """Least squares of t on [2·L·x + x², x, 1, L] (without L: γ forced to 0), columns scaled to unit
    norm, with each coefficient's standard error sqrt(σ²·(XᵀX)⁻¹); for a benchmark that times every
    (chunk, prefix) shape itself, where the engine's two-stage fit (`fit_startup`, `fit_runtime`) has
    no attention-free forward to take b and c from."""
    x = np.asarray(chunks, dtype=np.float64)
    prefix = np.asarray(prefixes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    raw = np.stack([attention_area(prefix, x), x, np.ones_like(x)] + ([prefix] if with_gamma else []), axis=1)
    if len(t) <= raw.shape[1]:
        raise ValueError(f"{len(t)} samples cannot fit {raw.shape[1]} coefficients with an error")
    norms = np.linalg.norm(raw, axis=0)
    norms[norms == 0] = 1.0
    design = raw / norms
    scaled, *_ = np.linalg.lstsq(design, t, rcond=None)
    residual = t - design @ scaled
    sigma2 = float(residual @ residual) / (len(t) - design.shape[1])
    stderr = np.sqrt(np.maximum(np.diag(np.linalg.pinv(design.T @ design)) * sigma2, 0.0)) / norms
    coef = scaled / norms
    pad = (lambda v: [*v, 0.0]) if not with_gamma else list  # noqa: E731
    a, b, c, gamma = pad(coef.tolist())
    ea, eb, ec, egamma = pad(stderr.tolist())
    return FreeFit(LatencyModel(a=a, b=b, c=c, gamma=gamma), LatencyModel(a=ea, b=eb, c=ec, gamma=egamma),
                   relative_rms(residual, t))
