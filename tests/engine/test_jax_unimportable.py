"""The host side runs where jax cannot even be imported: the engine, the scheduler, the chunk controller
and the gRPC server, on the fake executor. Proved in a subprocess whose import hook makes `import jax`
(and jaxlib, flax) fail, running real tests of the engine and of serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST_ONLY_TESTS = ["tests/engine/test_engine_fake.py", "tests/engine/test_scheduler.py",
                   "tests/engine/test_prefix_cache.py", "tests/serving/test_server_fake.py",
                   "tests/structured/test_constraint.py", "tests/structured/test_grammar_pool.py",
                   "tests/structured/test_tool_calls.py"]
BLOCK_JAX = """
import sys
class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):
            raise ImportError(f'{name} is blocked: host-only run')
sys.meta_path.insert(0, NoJax())
import pytest
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))
"""


def test_engine_and_serving_tests_pass_with_jax_unimportable():
    out = subprocess.run([sys.executable, "-c", BLOCK_JAX, *HOST_ONLY_TESTS], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "failed" not in out.stdout.splitlines()[-1]


def test_the_hook_really_blocks_jax():
    code = BLOCK_JAX.replace("import pytest\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))",
                             "import jax")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "blocked: host-only run" in out.stderr
