"""The tree's own rules, checked on the whole package so no hand-kept list can fall behind:

- the host side (every module of `jaxcpp` outside `jaxcpp.runtime`, and all of `jaxcpp.serving`) imports
  no jax, jaxlib or flax, at any depth: walked, then imported in one interpreter whose import hook
  refuses jax (an import anywhere below fails loudly, whichever module pulled it in);
- no import circle between the package's own modules, type-only and lazy imports counted
  (scripts/code_metrics.py's graph, which docs/architecture.md reports).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_SIDE = ("jaxcpp/runtime/",)  # and jaxcpp.models / jaxcpp.kernels, which are not walked: see below


def load_code_metrics():
    spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "scripts" / "code_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_modules() -> list[str]:
    """Every module of jaxcpp/ (runtime/ apart) and serving/. What they import of jaxcpp.models (its
    config and spec) is checked through them; the rest of models/ and kernels/ is device side."""
    metrics = load_code_metrics()
    names = []
    for rel in metrics.source_files(ROOT):
        if rel.startswith(("jaxcpp/", "serving/")) and not rel.startswith(DEVICE_SIDE):
            names.append(metrics.module_name(rel))
    return sorted(names)


BLOCK_JAX_AND_IMPORT = """
import importlib, sys
class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):
            raise ImportError(f'{name} is blocked: host-only import')
sys.meta_path.insert(0, NoJax())
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as error:
        failed.append(f'{name}: {error}')
if not failed and 'jaxcpp.serving.cli' in sys.argv[1:]:
    from jaxcpp.serving.cli import build_parser
    build_parser()  # every flag, generated from the config dataclasses, still with no jax
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))
print('\\n'.join(failed) or 'ok', heavy)
sys.exit(1 if failed or heavy else 0)
"""


def test_the_walk_finds_the_host_core_and_the_front_ends():
    names = host_modules()
    for expected in ("jaxcpp.core.engine", "jaxcpp.chunking.controller", "jaxcpp.head.mp_executor",
                     "jaxcpp.tools.simulator", "jaxcpp.llm", "jaxcpp.serving.server", "jaxcpp.serving.cli"):
        assert expected in names
    assert not [n for n in names if n.startswith(("jaxcpp.runtime", "jaxcpp.models", "jaxcpp.kernels"))]
    assert len(names) >= 50


def test_host_modules_import_no_jax_at_any_depth():
    out = subprocess.run([sys.executable, "-c", BLOCK_JAX_AND_IMPORT, *host_modules()], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_the_hook_fails_a_module_that_imports_jax():
    out = subprocess.run([sys.executable, "-c", BLOCK_JAX_AND_IMPORT, "jaxcpp.runtime.sampler"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "blocked: host-only import" in out.stdout


def test_no_import_circle_in_the_package():
    metrics = load_code_metrics()
    files = metrics.source_files(ROOT)
    modules = {name: ast.parse(path.read_text()) for rel, path in files.items() if (name := metrics.module_name(rel))}
    assert metrics.import_circles(metrics.import_graph(modules)) == []


def test_a_type_only_circle_is_found():
    """The check sees through `if TYPE_CHECKING:` and function-level imports (the circle this test was
    written for ran through both)."""
    metrics = load_code_metrics()
    modules = {
        "jaxcpp.a": ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxcpp.b import B\n"),
        "jaxcpp.b": ast.parse("def f():\n    from jaxcpp.c import C\n"),
        "jaxcpp.c": ast.parse("from jaxcpp.a import A\n"),
    }
    assert metrics.import_circles(metrics.import_graph(modules)) == [["jaxcpp.a", "jaxcpp.b", "jaxcpp.c"]]
