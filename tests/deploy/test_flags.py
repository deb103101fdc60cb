"""Every `jaxcpp serve` flag in a manifest or an image's entry point exists in the real CLI parser and takes
its value, so a renamed flag breaks this test, not a deployment. The flags of issue 10 (stage processes:
ISSUE_10_FLAGS) are checked like every other one, and with the others they must make a valid config."""

from __future__ import annotations

import argparse

import pytest

from jaxcpp.cli_args import engine_config_from_args, server_config_from_args
from jaxcpp.serving.cli import build_parser
from tests.deploy.conftest import (
    DOCKERFILES,
    POD_ENV,
    all_pod_templates,
    dockerfile_serve_args,
    expand_env,
    flag_name,
)


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _serve_arg_lists() -> list[tuple[str, list[str]]]:
    lists = [(f"{d.name}:ENTRYPOINT+CMD", dockerfile_serve_args(d)) for d in DOCKERFILES]
    for t in all_pod_templates():
        for container in t.serve_containers():
            lists.append((f"{t.id}:{container['name']}", [expand_env(a, POD_ENV) for a in container["args"]]))
    return lists


def _split_flags(args: list[str]) -> list[list[str]]:
    """Each flag with its value: ['--a=1'], ['--b', '2'], ['--switch']."""
    flags: list[list[str]] = []
    for arg in args:
        if arg.startswith("--"):
            flags.append([arg])
        else:
            assert flags, f"value {arg!r} before any flag"
            flags[-1].append(arg)
    return flags


def _flag_cases() -> list:
    cases = []
    for where, args in _serve_arg_lists():
        for flag in _split_flags(args):
            name = flag_name(flag[0])
            cases.append(pytest.param(flag, id=f"{where}:{name}"))
    return cases


ARG_LISTS = _serve_arg_lists()


def test_every_serve_container_and_image_is_covered() -> None:
    # 2 images + 12 pod templates, for ROCm and for CUDA: single node, a Deployment; multi-host, a leader and
    # a worker; disaggregated, a producers' leader and worker and a consumers' Deployment. Nothing slips
    # past the flag check.
    assert len(DOCKERFILES) == 2 and len(ARG_LISTS) == 14


@pytest.mark.parametrize("flag", _flag_cases())
def test_flag_exists_in_jaxcpp_serve(flag: list[str]) -> None:
    parser = _serve_parser()
    name = flag_name(flag[0])
    assert name in parser._option_string_actions, f"`jaxcpp serve` has no flag {name}"
    parser.parse_args(flag)  # the value parses (type, choices); argparse exits 2 otherwise


@pytest.mark.parametrize(("where", "args"), ARG_LISTS, ids=[w for w, _ in ARG_LISTS])
def test_flags_together_make_a_valid_config(where: str, args: list[str]) -> None:
    """Cross-flag rules (e.g. --max-num-seqs <= --max-num-batched-tokens, --num-processes equal to
    --pipeline-parallel-size) hold for the flags together."""
    parsed = _serve_parser().parse_args(args)
    engine_config_from_args(parsed)
    server = server_config_from_args(parsed)
    assert server.host == "0.0.0.0", f"{where}: bind every interface inside a container, or nothing reaches it"


def test_a_truncated_or_renamed_flag_is_caught() -> None:
    parser = _serve_parser()
    # argparse takes an unambiguous prefix, so parsing alone would let a truncated flag through (and a
    # later flag that makes the prefix ambiguous would break the deployment): hence the exact-name check.
    assert parser.parse_args(["--max-num-batched-token=2048"]).max_num_batched_tokens == 2048
    assert "--max-num-batched-token" not in parser._option_string_actions
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-batched-tokens=2048"])
