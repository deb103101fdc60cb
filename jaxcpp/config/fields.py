"""What every config section is made of: `opt` (a field and the help of its flag), `require` (a check
whose error names the flag) and `ConfigError`. Host-side: no jax here."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


def flag_name(name: str) -> str:
    """The flag of a field: `max_num_seqs` -> `--max-num-seqs`."""
    return "--" + name.replace("_", "-")


def require(ok: bool, name: str, message: str) -> None:
    """ConfigError naming the flag of field `name` unless `ok`."""
    if not ok:
        raise ConfigError(f"{flag_name(name)}: {message}")


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with CLI help text (and `choices=` for argparse)."""
    return field(default=default, metadata={"help": help, **kw})
