"""Static code numbers: non-blank lines per layer, the longest functions, import circles.

    python scripts/code_metrics.py [ROOT]     # ROOT: a checkout (default: this one)

Import circles are found over every `from X import ...` between the package's own modules, lazy
(inside functions) and TYPE_CHECKING ones included, as strongly connected components.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = {"jaxcpp": "jaxcpp", "models": "jaxcpp.models", "kernels": "jaxcpp.kernels", "serving": "jaxcpp.serving"}
LAYERS = ("jaxcpp/runtime", "jaxcpp/chunking", "jaxcpp/tools", "jaxcpp", "models", "kernels", "serving", "tests")


def source_files(root: Path) -> dict[str, Path]:
    files = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith(("serving/gen/", ".venv/", "benchmarks/", "scripts/")) and "/." not in rel:
            files[rel] = path
    return files


def module_name(rel: str) -> str | None:
    top, *rest = rel[:-3].split("/")
    if top not in PACKAGES:
        return None
    return ".".join([PACKAGES[top], *rest]).removesuffix(".__init__")


def lines_per_layer(files: dict[str, Path]) -> dict[str, tuple[int, int]]:
    totals = {layer: (0, 0) for layer in LAYERS}
    for rel, path in files.items():
        layer = next(layer for layer in LAYERS if rel.startswith(layer + "/"))
        n = sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))
        lines, count = totals[layer]
        totals[layer] = (lines + n, count + 1)
    return totals


def import_circles(modules: dict[str, ast.Module]) -> list[list[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                graph[name] |= {t for t in targets if t in modules and t != name}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    files = source_files(root)
    print("non-blank, non-comment lines per layer:")
    for layer, (lines, count) in lines_per_layer(files).items():
        print(f"  {layer}: {lines} in {count} files")
    modules = {name: ast.parse(path.read_text()) for rel, path in files.items() if (name := module_name(rel))}
    functions = sorted(((node.end_lineno or node.lineno) - node.lineno + 1, f"{name}.{node.name}")
                       for name, tree in modules.items() for node in ast.walk(tree)
                       if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))
    print("longest functions:", ", ".join(f"{f} ({n})" for n, f in reversed(functions[-6:])))
    print("import circles:", import_circles(modules) or "none")


if __name__ == "__main__":
    main()
