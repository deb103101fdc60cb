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
