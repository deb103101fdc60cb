"""The docs a new user reads point only at things that exist, and explain the names they use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_LEVEL = {p.name for p in REPO.iterdir()}
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
FILE_LIKE = re.compile(r"^[\w.-]+(/[\w.-]+)+\.(py|md|proto|json|toml|png|txt)$")


def relative_links(text: str) -> list[str]:
    return [t.split("#")[0] for t in LINK.findall(text) if not re.match(r"^(https?:|mailto:|#)", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_and_paths_exist(doc: Path) -> None:
    text = doc.read_text()
    missing = [t for t in relative_links(text) if t and not (doc.parent / t).exists()]
    # Backticked repository paths (`benchmarks/serving.py`, `serving/proto/...`) must be in the repo too.
    paths = [t for t in CODE.findall(text) if FILE_LIKE.match(t) and t.split("/")[0] in TOP_LEVEL]
    missing += [t for t in paths if not (REPO / t).exists()]
    assert missing == [], f"{doc.name} points to files that are not in the repo: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_references_to_material_outside_the_repo(doc: Path) -> None:
    text = doc.read_text()
    found = re.findall(r"seed `?0\d\d|DYNAMIC_CHUNKING\.md|DESIGN\.md|\(issue \d+\)", text)
    assert found == [], f"{doc.name} refers to material a reader cannot see: {found}"


def test_readme_says_what_the_borrowed_names_are() -> None:
    readme = REPO / "README.md"
    references = readme.read_text().split("## References", 1)
    assert len(references) == 2, "README.md has no References section"
    for name, link in (("Sarathi-Serve", "arxiv.org/abs/2403.02310"), ("ATOM", "github.com/ROCm/ATOM"),
                       ("latency model", "dynamic_chunking_guide")):
        assert name in references[1] and link in references[1], name


def test_readme_states_the_python_version_and_shows_a_hugging_face_model() -> None:
    text = (REPO / "README.md").read_text()
    assert "Python 3.11 or newer" in text
    section = text.split("## Using a Hugging Face model", 1)
    assert len(section) == 2 and "huggingface-cli download" in section[1] and "--model " in section[1]


def test_serving_numbers_live_in_benchmarks_only() -> None:
    serving = (REPO / "docs" / "serving.md").read_text()
    assert not re.search(r"\d+(\.\d+)? ?ms/token", serving), "serving.md quotes a per-token time"
    assert "benchmarks.md#serving-over-grpc" in serving
    assert "## Serving over gRPC" in (REPO / "docs" / "benchmarks.md").read_text()


def code_block_lines(text: str) -> list[str]:
    """Lines of fenced (```) and indented (4 spaces after a blank line) code blocks."""
    lines, fenced, indented, previous = [], False, False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line)
        else:
            indented = line.startswith("    ") and (indented or not previous.strip())
            if indented:
                lines.append(line)
        previous = line
    return lines


# a command line, not a program's output ("jaxcpp serve: error: ..."): the subcommand ends at a space
BARE_COMMAND = re.compile(r"(?:^|&&|\||;)\s*(?:\$\s+)?(?:\w+=\S+\s+)*"
                          r"jaxcpp\s+(?:serve|client|generate|chunk-plan)(?=\s|$)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_are_spelled_as_the_readme_spells_them(doc: Path) -> None:
    """`.venv/bin/jaxcpp ...` runs from a checkout as it is; README.md says once how to put it on PATH."""
    bare = [line.strip() for line in code_block_lines(doc.read_text()) if BARE_COMMAND.search(line)]
    assert bare == [], f"{doc.name}: commands spelled `jaxcpp ...` instead of `.venv/bin/jaxcpp ...`: {bare}"


def test_readme_says_how_to_put_the_command_on_path() -> None:
    text = (REPO / "README.md").read_text()
    assert "source .venv/bin/activate" in text and ".venv/bin/jaxcpp" in text


def test_deploy_status_names_only_flags_serve_has_and_calls_none_missing() -> None:
    import argparse

    from jaxcpp.serving.cli import build_parser

    status = (REPO / "docs" / "deploy.md").read_text().split("**Status.**", 1)[1].split("\n\n", 1)[0]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve_flags = {o for a in sub.choices["serve"]._actions for o in a.option_strings}
    named = set(re.findall(r"`(--[a-z-]+)`", status))
    assert named and named <= serve_flags, named - serve_flags
    assert not re.search(r"not have|do(es)? not exist|expected failure", status), status


def test_readme_flag_table_names_each_flag_once_and_make_test_says_what_it_costs() -> None:
    """A flag listed twice had two meanings (issue 34: `--host`, `--port`); `make test` takes minutes
    to an hour, which the two commands' block says, pointing at the quicker `make test-fast`."""
    text = (REPO / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    flags = [f for row in rows for f in re.findall(r"`(--[a-z0-9-]+)", row.split(" | ")[0])]
    assert rows and len(flags) == len(set(flags)), sorted({f for f in flags if flags.count(f) > 1})
    two_commands = text.split("## Two commands", 1)[1].split("```", 2)[1]
    assert "make test-fast" in two_commands and re.search(r"\d+-\d+ minutes", two_commands), two_commands


def documented_serve_commands() -> list[tuple[str, str]]:
    """(doc name, command) for every `.venv/bin/jaxcpp serve` in a code block, continuation lines joined."""
    found = []
    for doc in DOCS:
        joined = "\n".join(code_block_lines(doc.read_text())).replace("\\\n", " ")
        for line in joined.splitlines():
            if ".venv/bin/jaxcpp serve" in line:
                found.append((doc.name, line.split(".venv/bin/jaxcpp serve", 1)[1]))
    return found


def manifest_serve_commands() -> list[tuple[str, list[str]]]:
    """(manifest name, args) of every container in deploy/kubernetes that runs `jaxcpp serve`."""
    import yaml

    def containers(node: object) -> list[dict]:
        if isinstance(node, dict):
            found = [node] if node.get("command") == ["jaxcpp", "serve"] else []
            return found + [c for v in node.values() for c in containers(v)]
        return [c for v in node for c in containers(v)] if isinstance(node, list) else []

    return [(path.name, c.get("args", [])) for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc for c in containers(doc)]


def _serve_config(words: list[str]) -> object:
    from jaxcpp.cli_args import engine_config_from_args
    from jaxcpp.serving.cli import build_parser

    for i, word in enumerate(words):  # the command ends where the shell's next one starts
        if word in ("&&", "||", "|", ";", "&"):
            words = words[:i]
            break
    # a pod's $(VAR)s (distributed flags, addresses) are the orchestrator's to fill in
    return engine_config_from_args(build_parser().parse_args(["serve", *(w for w in words if "$(" not in w)]))


def test_documented_dynamic_chunking_commands_turn_it_on(caplog: pytest.LogCaptureFixture) -> None:
    """A documented command that asks for dynamic chunking gets it: its flags do not make the controller turn
    itself off ("Dynamic chunking turned off: --dynamic-chunking-min-chunk-size (4096) must be below
    --max-num-batched-tokens (512)" was what the disaggregation example's producer logged)."""
    import shlex

    from jaxcpp.chunking.controller import ChunkingState, DynamicChunkController
    from jaxcpp.core.buckets import token_buckets

    commands = [(doc, shlex.split(command, comments=True)) for doc, command in documented_serve_commands()]
    checked, off = 0, []
    for doc, words in commands + manifest_serve_commands():
        if "--enable-dynamic-chunking" not in words:
            continue
        command = " ".join(words)
        config = _serve_config(words)
        if not config.dynamic_chunking:  # a kv_consumer's: off by design, and the docs say so
            continue
        caplog.clear()
        buckets = token_buckets(config.scheduler.max_num_batched_tokens, config.cache.page_size)
        controller = DynamicChunkController.from_config(config, allowed_sizes=tuple(buckets))
        controller.startup_sweep_sizes()  # gives up when the budget leaves no start-up baseline
        checked += 1
        if controller.state in (ChunkingState.OFF, ChunkingState.GAVE_UP) or "Dynamic chunking" in caplog.text:
            off.append(f"{doc}: {command.strip()}: {caplog.text.strip()}")
    assert checked >= 11, "README, docs/disaggregation.md, docs/pipeline.md and the multi-host manifests' pods"
    assert off == [], "documented commands whose dynamic chunking turns itself off:\n" + "\n".join(off)
