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
