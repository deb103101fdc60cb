"""Log set-up shared by the `jaxcpp` CLI and `LLM`: the project's lines shown, third-party chatter kept below.

JAX, absl and orbax log at INFO on every start (JAX's "Unable to initialize backend 'tpu'", orbax's
handler registrations, absl's checkpoint notes), which buries the project's own progress lines. So both
entry points set those loggers to WARNING unless the chosen level is DEBUG, and leave alone any of them
the program has given a level itself.

`LLM(...)` shows its start-up progress (weights loaded, compiled bucket i/N, engine ready) on stderr
when the program has configured no logging at all (no root handler): a program that has configured
logging keeps full control. `JAXCPP_CONFIGURE_LOGGING=0` turns this off. Host side: no jax here.
"""

from __future__ import annotations

import logging
import os

THIRD_PARTY_LOGGERS = ("jax", "absl", "orbax")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PACKAGE_LOGGER = "jaxcpp"


def quiet_third_party(level: int | str) -> None:
    """Third-party loggers to WARNING unless `level` is DEBUG; ones the program already set are kept."""
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if isinstance(numeric, int) and numeric <= logging.DEBUG:
        return
    for name in THIRD_PARTY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def configure_cli_logging(level: str) -> None:
    """The CLI's logging: `level` (debug, info, ...) for the project, third parties at WARNING but in debug."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    quiet_third_party(level)


def show_startup_progress() -> None:
    """For `LLM`: INFO lines of the `jaxcpp` loggers on stderr, when the program configured no logging."""
    if os.environ.get("JAXCPP_CONFIGURE_LOGGING", "1") == "0":
        return
    package = logging.getLogger(_PACKAGE_LOGGER)
    if logging.getLogger().handlers or package.handlers:
        quiet_third_party(package.getEffectiveLevel())
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)
    quiet_third_party(package.getEffectiveLevel())
