"""Generate argparse flags from the config dataclasses, and build configs back from parsed flags.

One source of truth: a field `max_num_batched_tokens` in `SchedulerConfig` becomes
`--max-num-batched-tokens`, with the field's help, type and choices; booleans get `--x/--no-x`.
Every flag's help ends with its default, taken from the dataclass (argparse's own default is None, so
that a flag left out keeps the dataclass default and `--help` would otherwise say "None").
A tool that needs only some fields (`jaxcpp chunk-plan`) takes those by name with `only=`.

This is also where the command line meets the environment a deployment sets (the config dataclasses
never read it): a flag given wins, then the variable, then the dataclass default.

    JAX_COORDINATOR_ADDRESS, else LWS_LEADER_ADDRESS + ":8476"   --coordinator-address
    JAX_NUM_PROCESSES, else LWS_GROUP_SIZE                       --num-processes
    JAX_PROCESS_ID, else LWS_WORKER_INDEX                        --process-id
    JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR                        --dynamic-chunking-smooth-factor
    POD_IP                                                       kv_ip of --kv-transfer-config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

from jaxcpp.config import (
    DEPRECATED_ALIASES,
    ENGINE_SECTIONS,
    SMOOTH_FACTOR_ENV,
    ConfigError,
    EngineConfig,
    ServerConfig,
)

log = logging.getLogger(__name__)


class _DeprecatedAlias(argparse.Action):
    """Stores into the new name's field and says so on stderr (`--block-size` -> `--page-size`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        new = DEPRECATED_ALIASES[self.dest.removeprefix("_alias_")]
        print(f"{parser.prog}: warning: {option_string} is deprecated: use --{new.replace('_', '-')}",
              file=sys.stderr)
        setattr(namespace, new, values)


def _base_type(annotation: Any) -> type:
    hint = annotation
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _describe_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _help_with_default(fld: dataclasses.Field[Any], required: bool) -> str:
    help_text = fld.metadata.get("help", "")
    if required:
        return f"{help_text} (required)"
    if "(default" in help_text:  # the help explains its own default (e.g. one read from the environment)
        return help_text
    return f"{help_text} (default: {_describe_default(fld.default)})"


def add_config_args(parser: argparse.ArgumentParser, config_cls: type, only: Collection[str] | None = None,
                    required: Collection[str] = ()) -> None:
    """Flags for `config_cls`'s fields (or the fields named in `only`); those in `required` must be given."""
    hints = typing.get_type_hints(config_cls)
    group = parser.add_argument_group(config_cls.__name__)
    for fld in dataclasses.fields(config_cls):
        if only is not None and fld.name not in only:
            continue
        flag = "--" + fld.name.replace("_", "-")
        must = fld.name in required
        help_text = _help_with_default(fld, must)
        kind = _base_type(hints[fld.name])
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=None, choices=fld.metadata.get("choices"),
                               required=must, help=help_text)
    for old, new in DEPRECATED_ALIASES.items():
        if new in {f.name for f in dataclasses.fields(config_cls)} and (only is None or new in only):
            group.add_argument("--" + old.replace("_", "-"), dest="_alias_" + old, action=_DeprecatedAlias,
                               type=_base_type(hints[new]), help=argparse.SUPPRESS)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for cls in ENGINE_SECTIONS.values():
        add_config_args(parser, cls)


def _given(args: argparse.Namespace, config_cls: type) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(config_cls)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def engine_config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> EngineConfig:
    """Every engine section from the flags given, else the environment (module docstring); a section whose
    flags were not added keeps its defaults. What the config turns off that was asked for is logged."""
    given: dict[str, Any] = {}
    for cls in ENGINE_SECTIONS.values():
        given |= _given(args, cls)
    config = EngineConfig.from_kwargs(**with_environment(given, environ))
    for warning in config.startup_warnings():
        log.warning(warning)
    return config


def with_environment(given: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Engine flags by field name: those `given`, and those the environment sets that were not given."""
    values = {**_from_environment(environ), **given}
    pod_ip = environ.get("POD_IP")
    if values.get("kv_transfer_config") is not None and pod_ip:
        values["kv_transfer_config"] = _with_kv_ip(values["kv_transfer_config"], pod_ip)
    return values


def _from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    leader = environ.get("LWS_LEADER_ADDRESS")
    found = {
        "coordinator_address": environ.get("JAX_COORDINATOR_ADDRESS") or (f"{leader}:8476" if leader else None),
        "num_processes": _number(environ, int, "JAX_NUM_PROCESSES", "LWS_GROUP_SIZE"),
        "process_id": _number(environ, int, "JAX_PROCESS_ID", "LWS_WORKER_INDEX"),
        "dynamic_chunking_smooth_factor": _number(environ, float, SMOOTH_FACTOR_ENV),
    }
    return {name: value for name, value in found.items() if value is not None}


def _number(environ: Mapping[str, str], kind: type[int] | type[float], *names: str) -> int | float | None:
    """The first of `names` set, as `kind` (JAX's variables first, then LWS's)."""
    for name in names:
        value = environ.get(name)
        if value:
            try:
                return kind(value)
            except ValueError:
                expected = "an integer" if kind is int else "a number"
                raise ConfigError(f"environment variable {name}: expected {expected}, got {value!r}") from None
    return None


def _with_kv_ip(kv_transfer_config: str, pod_ip: str) -> str:
    """--kv-transfer-config with kv_ip = env POD_IP when its JSON leaves kv_ip out: the same args then serve
    every pod of a Kubernetes set. JSON the config would refuse is left for it to name the problem."""
    try:
        given = json.loads(kv_transfer_config)
    except json.JSONDecodeError:
        return kv_transfer_config
    if not isinstance(given, dict) or given.get("kv_ip"):
        return kv_transfer_config
    return json.dumps({**given, "kv_ip": pod_ip})


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**_given(args, ServerConfig))
