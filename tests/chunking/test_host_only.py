"""jaxcpp.chunking and jaxcpp.tools: no jax import anywhere in their source, not even inside a function (the
import-time walk is tests/test_architecture.py's), and matplotlib only inside the plot function."""

import ast
import pathlib

import jaxcpp.chunking
import jaxcpp.tools

PACKAGE = pathlib.Path(jaxcpp.chunking.__file__).parent
TOOLS = pathlib.Path(jaxcpp.tools.__file__).parent


def imported_modules(tree: ast.AST, top_level_only: bool) -> set[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_jax_and_no_top_level_matplotlib():
    files = sorted(PACKAGE.glob("*.py")) + sorted(TOOLS.glob("*.py"))
    assert len(files) >= 12
    for path in files:
        tree = ast.parse(path.read_text())
        assert not {"jax", "jaxlib", "flax"} & imported_modules(tree, top_level_only=False), path.name
        assert "matplotlib" not in imported_modules(tree, top_level_only=True), path.name
