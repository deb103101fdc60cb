"""Load a module of this repository as it was at another git revision, for before/after runs in one process.

    old = module_at_revision("kernels/ragged_paged_attention.py", "main")
    use_ladder_at("main")    # the engines built from now on pad steps as `main` did

The file is read with `git show REV:PATH` and imported under a private name, so the current code and the
old one sit side by side (the old file's own `jaxcpp.*` imports resolve to the current package, which is
what a change confined to that file wants).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def module_at_revision(path: str, revision: str) -> ModuleType:
    try:
        source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--baseline: cannot read {path} at {revision!r}: {e.stderr.strip()}") from e
    name = f"_baseline_{Path(path).stem}_{abs(hash(revision))}"
    folder = Path(tempfile.mkdtemp(prefix="jaxcpp-baseline-"))
    file = folder / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def use_ladder_at(revision: str) -> None:
    """Make the engines built from now on use the bucket ladder of `revision`: its token buckets, and its
    decode-only rungs (none before there were any)."""
    import jaxcpp.core.sizing as sizing

    old = module_at_revision("jaxcpp/core/buckets.py", revision)
    sizing.token_buckets = old.token_buckets
    sizing.decode_buckets = getattr(old, "decode_buckets", lambda max_num_seqs, page_size: [])
