"""Static code numbers: files and lines per folder, the longest functions, duplicate runs, import circles.

    python scripts/code_metrics.py [ROOT]     # ROOT: a checkout (default: this one)

Lines are non-blank, non-comment lines. Import circles are found over every `from X import ...` between
the package's own modules, lazy (inside functions) and TYPE_CHECKING ones included, and over every
module a command line launches (`[..., "-m", "jaxcpp.runtime.stage_process", ...]`: that process runs
the module, so the launcher depends on it), as strongly connected components. Duplicate runs: `RUN` or more
consecutive code lines (blank, comment, import and lone-bracket lines skipped, white space folded) that
stand identically in two places of the package (tests left out).
"""

from __future__ import annotations

import ast
import keyword
import re
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = {"jaxcpp": "jaxcpp", "models": "jaxcpp.models", "kernels": "jaxcpp.kernels", "serving": "jaxcpp.serving"}
RUN = 6  # lines that make a duplicate run


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


def code_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))


def lines_per_folder(files: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """(lines, files) of each folder's own files, subfolders apart; tests summed as one."""
    totals: dict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for rel, path in files.items():
        folder = "tests" if rel.startswith("tests/") else rel.rpartition("/")[0] or "."
        lines, count = totals[folder]
        totals[folder] = (lines + code_lines(path), count + 1)
    return dict(sorted(totals.items()))


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.List | ast.Tuple):  # [..., "-m", "jaxcpp.x.y", ...]: a launched module
                words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                targets = [str(m) for flag, m in zip(words, words[1:], strict=False) if flag == "-m"]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def _normalized(path: Path, shape: bool) -> list[tuple[int, str]]:
    """(line number, text with white space folded) of the lines that count as code for duplicates;
    with `shape`, every name, string and number folded too (lines alike but for names and values)."""
    text, out = path.read_text(), []
    docstrings = {n for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                  for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
    for number, raw in enumerate(text.splitlines(), 1):
        line = " ".join(raw.split())
        skipped = line.startswith(("#", "import ", "from ")) or all(c in "()[]{}:,." for c in line)
        if not line or number in docstrings or skipped:
            continue
        if shape:
            line = _WORD.sub(lambda m: m.group() if keyword.iskeyword(m.group()) else "_", _STRING.sub("'", line))
        out.append((number, line))
    return out


_STRING = re.compile(r"""[rbfu]*('[^']*'|"[^"]*")""")
_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|\d[\d_.e]*")


def duplicate_runs(files: dict[str, Path], shape: bool = False) -> list[tuple[int, str, str]]:
    """(lines, place, other place) of each maximal run of >= RUN identical (or, with `shape`, alike)
    lines standing twice."""
    texts = {rel: _normalized(path, shape) for rel, path in files.items() if not rel.startswith("tests/")}
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for rel, lines in texts.items():
        for i in range(len(lines) - RUN + 1):
            windows[tuple(text for _, text in lines[i:i + RUN])].append((rel, i))
    matches: set[tuple[str, int, str, int]] = set()
    for places in windows.values():
        if 2 <= len(places) <= 8:  # more places than that is boilerplate, not a copy
            matches |= {(a, i, b, j) for a, i in places for b, j in places if (a, i) < (b, j)}
    runs = []
    for a, i, b, j in matches:
        if (a, i - 1, b, j - 1) in matches:
            continue  # not the start of its run
        n = 0
        while (a, i + n, b, j + n) in matches:
            n += 1
        length = n + RUN - 1
        if a == b and j < i + length:
            continue  # a run that overlaps itself: repeated lines (fields, rows), not a copy
        first, last = texts[a][i][0], texts[a][i + length - 1][0]
        other_first, other_last = texts[b][j][0], texts[b][j + length - 1][0]
        runs.append((length, f"{a}:{first}-{last}", f"{b}:{other_first}-{other_last}"))
    return sorted(runs, reverse=True)


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    files = source_files(root)
    print("files and non-blank, non-comment lines per folder (subfolders apart):")
    for folder, (lines, count) in lines_per_folder(files).items():
        print(f"  {folder}: {lines} lines in {count} files")
    package = {rel: path for rel, path in files.items() if not rel.startswith("tests/")}
    print(f"  package total: {sum(code_lines(p) for p in package.values())} lines in {len(package)} files")
    modules = {name: ast.parse(path.read_text()) for rel, path in files.items() if (name := module_name(rel))}
    functions = sorted(((node.end_lineno or node.lineno) - node.lineno + 1, f"{name}.{node.name}")
                       for name, tree in modules.items() for node in ast.walk(tree)
                       if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))
    print("longest functions:", ", ".join(f"{f} ({n})" for n, f in reversed(functions[-6:])))
    for shape, what in ((False, "identical"), (True, "alike but for names and values")):
        runs = duplicate_runs(files, shape)
        print(f"duplicate runs ({RUN}+ code lines {what}, in two places): {len(runs)}, "
              f"{sum(n for n, _, _ in runs)} lines")
        for n, a, b in runs[:6]:
            print(f"  {n} lines: {a} ~ {b}")
    print("import circles:", import_circles(import_graph(modules)) or "none")


if __name__ == "__main__":
    main()
