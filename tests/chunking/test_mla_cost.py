"""MLA's FLOP model (jaxcpp.chunking.mla_cost) and the free four-term fit (fitting.fit_free)."""

import math

import numpy as np
import pytest

from jaxcpp.chunking.fitting import fit_free
from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.mla_cost import (
    PREFILL_MODES,
    FormTiming,
    MlaShape,
    asymptotic_crossover,
    attention_flops,
    causal_pairs,
    crossover_chunk,
    fit_rebuild_weight,
    fixed_rebuild_weight,
    latency_terms,
    planned_form,
    prefer_rebuild,
)

V3 = MlaShape.deepseek_v3()


def test_deepseek_v3_counts():
    assert V3.latent_width == 576
    assert V3.kv_b_flops == 2 * 512 * 128 * 256  # 33.6 MFLOP a token a layer
    assert V3.pair_flops("absorbed") == 2 * 128 * 1088 and V3.pair_flops("rebuilt") == 2 * 128 * 320
    # By hand: one chunk of 3 after 2 cached tokens sees 3 + 4 + 5 = 12 pairs.
    assert causal_pairs(2, 3) == 12
    assert attention_flops(V3, 2, 3, "rebuilt") == V3.kv_b_flops * 5 + V3.pair_flops("rebuilt") * 12
    assert attention_flops(V3, 2, 3, "absorbed") == V3.kv_b_flops * 3 + V3.pair_flops("absorbed") * 12


def test_crossover_is_about_170_tokens_for_v3_whatever_the_heads():
    assert asymptotic_crossover(V3) == pytest.approx(512 * 256 / 768)  # 170.7
    fewer_heads = MlaShape(16, 512, 128, 64, 128)
    assert asymptotic_crossover(fewer_heads) == pytest.approx(asymptotic_crossover(V3))
    for prefix, low in ((1, 17), (1000, 158), (131072, 170.5)):  # grows towards 170.7 with the prefix
        x = crossover_chunk(V3, prefix)
        assert low < x < asymptotic_crossover(V3)
        assert not prefer_rebuild(V3, prefix, math.floor(x)) and prefer_rebuild(V3, prefix, math.ceil(x) + 1)
    assert crossover_chunk(V3, 0) == 0.0 and prefer_rebuild(V3, 0, 1)  # nothing cached: rebuild is free
    assert prefer_rebuild(V3, 131072, 4096) and not prefer_rebuild(V3, 131072, 64)  # chunks vs decodes


def test_no_crossover_when_absorbed_pairs_are_not_dearer():
    wide = MlaShape(4, 64, 128, 16, 128)  # 2r <= dn + dv: absorbed pairs are cheaper
    assert crossover_chunk(wide, 1000) == math.inf and asymptotic_crossover(wide) == math.inf
    assert not prefer_rebuild(wide, 1000, 10**6)


def test_latency_terms_and_bad_input():
    gamma, a = latency_terms(V3, 16, 1e15)
    assert gamma == pytest.approx(V3.kv_b_flops * 16 / 1e15)
    assert gamma / a == pytest.approx(2 * 512 * 256 / 320)  # 819: γ/a is the shape's, not the device's
    assert latency_terms(V3, 16, 1e15, "absorbed")[0] == 0.0
    with pytest.raises(ValueError, match="form must be"):
        latency_terms(V3, 16, 1e15, "dense")
    with pytest.raises(ValueError, match="MlaShape.kv_lora_rank"):
        MlaShape(8, 0, 128, 64, 128)


def test_fit_free_recovers_all_four_terms_with_errors_and_gamma_forced_to_zero():
    truth = LatencyModel(a=2e-9, b=3e-6, c=4e-3, gamma=5e-7)
    chunks = np.array([x for x in (256, 512, 1024, 2048) for _ in range(5)])
    prefixes = np.array([p for _ in range(4) for p in (0, 2048, 4096, 8192, 16384)])
    rng = np.random.default_rng(0)
    seconds = truth.predict(prefixes, chunks) * (1 + 0.01 * rng.standard_normal(len(chunks)))
    fit = fit_free(chunks, prefixes, seconds)
    for key in ("a", "b", "c", "gamma"):
        got, err, want = getattr(fit.model, key), getattr(fit.errors, key), getattr(truth, key)
        assert 0 < err and abs(got - want) < 4 * err, key
    assert fit.fit_error < 0.02
    no_gamma = fit_free(chunks, prefixes, seconds, with_gamma=False)
    assert no_gamma.model.gamma == 0.0 and no_gamma.errors.gamma == 0.0
    assert no_gamma.fit_error > 2 * fit.fit_error  # γ·L is a real share here: dropping it shows
    with pytest.raises(ValueError, match="samples cannot fit"):
        fit_free(chunks[:4], prefixes[:4], seconds[:4])


def test_rebuild_weight_moves_the_crossover_and_fixes_a_form():
    """Weight 1 is the FLOP rule; a device where the rebuild runs 2x slower a FLOP rebuilds later;
    inf never rebuilds (--mla-prefill absorbed), 0 always (rebuilt), and an empty chunk never does."""
    assert prefer_rebuild(V3, 4096, 256) and not prefer_rebuild(V3, 4096, 256, 2.0)
    assert prefer_rebuild(V3, 4096, 1024, 2.0)
    assert not prefer_rebuild(V3, 4096, 10**6, math.inf) and prefer_rebuild(V3, 4096, 1, 0.0)
    assert not prefer_rebuild(V3, 4096, 0, 0.0)
    assert [fixed_rebuild_weight(m) for m in PREFILL_MODES] == [None, 1.0, math.inf, 0.0]
    with pytest.raises(ValueError, match="--mla-prefill"):
        fixed_rebuild_weight("sometimes")


def test_fitted_weight_sorts_the_timed_points_as_measured():
    """This CPU (docs/benchmarks.md): absorbed faster at every point the FLOP rule rebuilds: the fitted
    weight rebuilds none of them. A GPU-like device where rebuilt wins past the FLOP crossover keeps
    the FLOP rule (weight 1, the nearest to it among perfect fits). A crossover between 256 and 512
    lands between them."""
    def timed(faster):  # faster(chunk) -> "rebuilt" or "absorbed"
        return [FormTiming(512, x, 1.0, 0.5 if faster(x) == "rebuilt" else 2.0) for x in (128, 256, 512)]

    cpu = fit_rebuild_weight(V3, timed(lambda x: "absorbed"))
    assert not any(prefer_rebuild(V3, 512, x, cpu) for x in (128, 256, 512))
    # The FLOP ratio absorbed / rebuilt tends to pair_a / pair_r (3.4 for V3) as the chunk grows, and
    # the weight sits above twice the largest timed ratio: absorbed for every chunk, as measured.
    assert cpu > V3.pair_flops("absorbed") / V3.pair_flops("rebuilt") and not prefer_rebuild(V3, 512, 10**6, cpu)
    flops = fit_rebuild_weight(V3, timed(lambda x: "rebuilt" if prefer_rebuild(V3, 512, x) else "absorbed"))
    assert flops == 1.0
    late = fit_rebuild_weight(V3, timed(lambda x: "rebuilt" if x >= 512 else "absorbed"))
    assert [prefer_rebuild(V3, 512, x, late) for x in (128, 256, 512)] == [False, False, True]
    assert planned_form(V3, late, (128, 512)) == "mixed"
    assert planned_form(V3, cpu, (128, 512)) == "absorbed" and planned_form(V3, 0.0, (128, 512)) == "rebuilt"
