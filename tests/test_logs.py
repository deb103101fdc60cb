"""jaxcpp.logs: the project's INFO lines shown, third-party INFO chatter hidden unless debug.

Each case runs in a fresh interpreter: logging is process-global, and pytest's own root handlers would
hide what a program without logging set-up sees.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Lines as JAX, absl (orbax's logger) and orbax emit them at start-up, then the project's own.
EMIT = """
import logging
logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu': no libtpu")
logging.getLogger("absl").info("orbax-checkpoint version: 0.12.8")
logging.getLogger("orbax.checkpoint").info("Created BasePyTreeCheckpointHandler")
logging.getLogger("jaxcpp.core.engine").info("engine ready")
logging.getLogger("jaxcpp.core.engine").debug("a debug line")
"""


def run(setup: str, env: dict[str, str] | None = None) -> str:
    import os

    result = subprocess.run([sys.executable, "-c", setup + EMIT], capture_output=True, text=True, check=True,
                            env={**os.environ, **(env or {})}, timeout=60)
    return result.stderr


@pytest.mark.parametrize("level", ["info", "warning"])
def test_cli_logging_hides_third_party_info(level: str) -> None:
    err = run(f"from jaxcpp.logs import configure_cli_logging; configure_cli_logging({level!r})")
    assert "tpu" not in err and "orbax" not in err and "BasePyTree" not in err, err
    assert ("engine ready" in err) == (level == "info")


def test_cli_debug_shows_everything() -> None:
    err = run("from jaxcpp.logs import configure_cli_logging; configure_cli_logging('debug')")
    for line in ("Unable to initialize backend 'tpu'", "orbax-checkpoint version", "BasePyTree", "engine ready",
                 "a debug line"):
        assert line in err, err


def test_llm_startup_progress_shows_without_any_logging_setup() -> None:
    err = run("from jaxcpp.logs import show_startup_progress; show_startup_progress()")
    assert "INFO jaxcpp.core.engine: engine ready" in err and "tpu" not in err and "orbax" not in err, err
    assert "a debug line" not in err


def test_a_program_that_configured_logging_keeps_control() -> None:
    setup = ("import logging; logging.basicConfig(level=logging.WARNING); "
             "from jaxcpp.logs import show_startup_progress; show_startup_progress()")
    assert "engine ready" not in run(setup)
    setup = ("import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s'); "
             "logging.getLogger('absl').setLevel(logging.INFO); "
             "from jaxcpp.logs import show_startup_progress; show_startup_progress()")
    err = run(setup)
    # The program's own choice for absl stands; JAX's unset logger is quieted; nothing printed twice.
    assert "orbax-checkpoint version" in err and "tpu" not in err and err.count("engine ready") == 1, err


def test_opt_out_by_environment() -> None:
    err = run("from jaxcpp.logs import show_startup_progress; show_startup_progress()",
              env={"JAXCPP_CONFIGURE_LOGGING": "0"})
    assert "engine ready" not in err


def test_a_warm_start_says_which_buckets_came_from_the_compilation_cache() -> None:
    from jaxcpp.core.buckets import bucket_progress

    assert bucket_progress(3, 11, 192, 4.25) == "compiled bucket 3/11: 192 tokens (4.2s)"  # no persistent cache
    assert bucket_progress(3, 11, 192, 4.25, programs=2) == "compiled bucket 3/11: 192 tokens (4.2s)"
    assert bucket_progress(3, 11, 192, 0.31, programs=2, from_cache=2, where=" on 2 stage(s)") == \
        "loaded bucket 3/11 on 2 stage(s) from the compilation cache: 192 tokens (0.3s)"
    assert bucket_progress(1, 2, 64, 2.0, programs=4, from_cache=3) == \
        "compiled bucket 1/2 (3 of 4 programs from the compilation cache): 64 tokens (2.0s)"


def test_the_servers_last_line_says_how_it_stopped() -> None:
    from jaxcpp.serving.cli import closing_line

    assert closing_line({"stop": 3, "length": 2, "abort": 1, "error": 1}, 0) == \
        "jaxcpp: stopped: 5 requests finished, 1 aborted, 1 failed, exit 0"
    assert closing_line({}, 1) == "jaxcpp: stopped: 0 requests finished, 0 aborted, 0 failed, exit 1"


@pytest.mark.slow  # two engines in fresh interpreters, the second warm from the first's cache
def test_in_process_warm_start_logs_cache_hits(tmp_path) -> None:
    import os

    code = ("from jaxcpp import LLM; LLM(model='tiny', dtype='float32', max_model_len=128, max_num_batched_tokens=64, "
            "max_num_seqs=8, log_stats_interval_s=0)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXCPP_COMPILATION_CACHE_DIR": str(tmp_path / "xla-cache")}
    logs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                           check=True).stderr for _ in range(2)]
    cold, warm = ([line for line in log.splitlines() if "bucket" in line and "/2" in line] for log in logs)
    assert len(cold) == len(warm) == 2, logs
    assert all("compiled bucket" in line and "cache" not in line for line in cold), cold
    assert all("loaded bucket" in line and "from the compilation cache" in line for line in warm), warm
