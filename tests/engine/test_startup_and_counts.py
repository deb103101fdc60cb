"""What a user reads at start-up and in the stats agrees with what happened, on the real engine:
every sampled token is counted (the first one, sampled by the last prefill chunk, too), the KV pages
the start-up line reports are the pages the stats report, and `LLM(...)` shows its progress."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from jaxcpp import SamplingParams

SMALL = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, record_logits=False)


@pytest.mark.slow  # one engine on the tiny model (one bucket)
def test_token_counts_and_kv_pages_agree_with_what_happened(make_llm, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="jaxcpp"):
        llm = make_llm(**SMALL)
    ready = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    pages_logged = int(re.search(r"(\d+) KV pages", ready).group(1))
    assert "reserved" in ready
    assert pages_logged == llm.engine.stats().num_pages_total

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5)]
    outs = llm.generate(["def f(", "import os\n"], params)
    stats = llm.engine.stats()
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert stats.num_generation_tokens_total == 8
    assert stats.num_prompt_tokens_total == sum(len(o.prompt_token_ids) for o in outs)


@pytest.mark.slow  # a fresh interpreter builds one engine
def test_llm_shows_startup_progress_in_a_plain_program(model_name, tmp_path) -> None:
    code = ("from jaxcpp import LLM; "
            f"LLM(model={model_name!r}, dtype='float32', max_model_len=256, max_num_batched_tokens=64, "
            "max_num_seqs=8, log_stats_interval_s=0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu",  # a cold cache: it compiles
                                 "JAXCPP_COMPILATION_CACHE_DIR": str(tmp_path / "xla-cache")}, check=True)
    err = result.stderr
    # two programs: the 64-token bucket and the decode-only rung of 8 (max_num_seqs 8)
    for line in ("weights loaded: ", "compiling 2 programs", "compiled bucket 2/2", "engine ready"):
        assert line in err, err
    assert err.index("weights loaded") < err.index("compiling") < err.index("engine ready")
    assert "absl" not in err and "orbax" not in err, err
