"""LatencyModel: the formula, its JSON form, and the --coeffs parser."""

import json

import numpy as np
import pytest

from jaxcpp.chunking.latency_model import LatencyModel


def test_predict_is_the_formula_for_scalars_and_arrays():
    m = LatencyModel(a=2.0, b=3.0, c=5.0, gamma=7.0)
    assert m.predict(10, 4) == 5 + 7 * 10 + 3 * 4 + 2 * (2 * 10 * 4 + 16)
    got = m.predict(np.array([0.0, 10.0]), np.array([4.0, 4.0]))
    np.testing.assert_allclose(got, [m.predict(0, 4), m.predict(10, 4)])


def test_attention_term_telescopes_over_any_cut():
    # Σ a·(2·L_i·x_i + x_i²) = a·N² whatever the chunks: the identity the planners rest on.
    m = LatencyModel(a=1.0, b=0.0, c=0.0, gamma=0.0)
    chunks = [300, 17, 1024, 5]
    prefixes = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    pieces = zip(prefixes, chunks, strict=True)
    assert sum(m.predict(float(p), float(x)) for p, x in pieces) == sum(chunks) ** 2


def test_json_round_trip_and_file(tmp_path):
    m = LatencyModel(a=2.9e-10, b=5.365e-6, c=0.005, gamma=4.727e-7)
    assert LatencyModel.from_json(m.to_json()) == m
    path = tmp_path / "m.json"
    m.save(path)
    assert LatencyModel.load(path) == m
    assert json.loads(path.read_text())["gamma"] == 4.727e-7


def test_from_json_names_missing_keys_and_rejects_other_formats():
    with pytest.raises(ValueError, match="lacks c, gamma"):
        LatencyModel.from_json('{"a": 1, "b": 2}')
    with pytest.raises(ValueError, match="unknown latency model format"):
        LatencyModel.from_json('{"format": "x/9", "a": 1, "b": 2, "c": 3, "gamma": 4}')
    with pytest.raises(ValueError, match="finite"):
        LatencyModel(a=float("nan"), b=1, c=0, gamma=0)


def test_parse_coeffs_and_describe():
    m = LatencyModel.parse_coeffs("1, 18500, 0, 1630")
    assert m == LatencyModel(1.0, 18500.0, 0.0, 1630.0)
    assert m.describe() == "a=1 b=18500 c=0 gamma=1630"
    with pytest.raises(ValueError, match="four numbers"):
        LatencyModel.parse_coeffs("1,2,3")
    assert m.scaled(2.0) == LatencyModel(2.0, 37000.0, 0.0, 3260.0)
