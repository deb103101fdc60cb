"""Generate argparse flags from the config dataclasses, and build configs back from parsed flags.

One source of truth: a field `max_num_batched_tokens` in `SchedulerConfig` becomes
`--max-num-batched-tokens`, with the field's help, type and choices; booleans get `--x/--no-x`.
Every flag's help ends with its default, taken from the dataclass (argparse's own default is None, so
that a flag left out keeps the dataclass default and `--help` would otherwise say "None").
A tool that needs only some fields (`jaxcpp chunk-plan`) takes those by name with `only=`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Collection
from typing import Any

from jaxcpp.config import DEPRECATED_ALIASES, ENGINE_SECTIONS, EngineConfig, ServerConfig


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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Every engine section from the flags given; a section whose flags were not added keeps its defaults."""
    return EngineConfig(**{name: cls(**_given(args, cls)) for name, cls in ENGINE_SECTIONS.items()})


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**_given(args, ServerConfig))
