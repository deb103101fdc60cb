"""The chunk latency model t(L, x) = c + γ·L + b·x + a·(2·L·x + x²), and its JSON form.

A chunk of x new prompt tokens after a cached prefix of L tokens costs, on one pipeline stage:
c per forward, γ per prefix token (cached-prefix state rebuilt every chunk, as in MLA models), b per
new token (the dense and MoE layers), and a per unit of attention area (2·L·x: new tokens against the
prefix, x²: new tokens among themselves; the causal half is folded into a). Calibration fits it
(`calibration.py`), the planners invert it (`planner.py`, `optimal.py`), the simulator runs it.

Units are whatever the timings were in (seconds from the engine); only ratios matter to the solver.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import overload

import numpy as np

_FORMAT = "jaxcpp.latency_model/1"
_KEYS = ("a", "b", "c", "gamma")


@overload
def attention_area(prefix_len: float, chunk: float) -> float: ...


@overload
def attention_area(prefix_len: np.ndarray, chunk: np.ndarray | float) -> np.ndarray: ...


def attention_area(prefix_len, chunk):  # type: ignore[no-untyped-def]
    """2·L·x + x²: the attention work of a chunk, the regressor of the `a` term (scalars or arrays)."""
    return 2.0 * prefix_len * chunk + chunk * chunk


@dataclass(frozen=True)
class LatencyModel:
    """Coefficients of t(L, x); immutable so a controller can hand one out without copying."""

    a: float
    b: float
    c: float
    gamma: float

    def __post_init__(self) -> None:
        for key in _KEYS:
            value = getattr(self, key)
            if not math.isfinite(value):
                raise ValueError(f"latency model coefficient {key} must be finite, got {value}")

    @overload
    def predict(self, prefix_len: float, chunk: float) -> float: ...

    @overload
    def predict(self, prefix_len: np.ndarray | float, chunk: np.ndarray) -> np.ndarray: ...

    @overload
    def predict(self, prefix_len: np.ndarray, chunk: np.ndarray | float) -> np.ndarray: ...

    def predict(self, prefix_len, chunk):  # type: ignore[no-untyped-def]
        """Predicted latency of a chunk of `chunk` tokens after `prefix_len` cached tokens.

        Accepts scalars or numpy arrays (broadcast), so planners can score many plans at once.
        """
        return (self.c + self.gamma * prefix_len + self.b * chunk
                + self.a * attention_area(prefix_len, chunk))

    def scaled(self, factor: float) -> LatencyModel:
        """Every term times `factor`: e.g. a stage with more layers, or PP 4 coefficients moved to PP 2."""
        return LatencyModel(self.a * factor, self.b * factor, self.c * factor, self.gamma * factor)

    def describe(self) -> str:
        """`a=… b=… c=… gamma=…`, the form of the 'model installed' log line."""
        return f"a={self.a:.6g} b={self.b:.6g} c={self.c:.6g} gamma={self.gamma:.6g}"

    def to_json(self) -> str:
        return json.dumps({"format": _FORMAT, **asdict(self)}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> LatencyModel:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("latency model JSON must be an object with keys a, b, c, gamma")
        missing = [key for key in _KEYS if key not in data]
        if missing:
            raise ValueError(f"latency model JSON lacks {', '.join(missing)}")
        if data.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"unknown latency model format {data['format']!r} (expected {_FORMAT})")
        return LatencyModel(**{key: float(data[key]) for key in _KEYS})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @staticmethod
    def load(path: str | Path) -> LatencyModel:
        return LatencyModel.from_json(Path(path).read_text())

    @staticmethod
    def parse_coeffs(text: str) -> LatencyModel:
        """`a,b,c,gamma` as the CLI's `--coeffs` takes them."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 4:
            raise ValueError(f"--coeffs expects four numbers a,b,c,gamma, got {text!r}")
        try:
            a, b, c, gamma = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"--coeffs expects four numbers a,b,c,gamma, got {text!r}") from None
        return LatencyModel(a, b, c, gamma)
