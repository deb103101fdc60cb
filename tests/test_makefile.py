"""The Makefile's setup: the Python version is checked before a venv exists, a failed setup leaves none.

Every run uses a fake interpreter and a venv path under tmp_path, so the real .venv is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def fake_python(folder: Path, version: str, venv_body: str = "exit 1") -> Path:
    """A `python` that reports `version` for `-c` and runs `venv_body` for `-m venv DIR`."""
    path = folder / "fakepython"
    path.write_text("#!/bin/sh\n"
                    f'if [ "$1" = "-c" ]; then echo {version}; exit 0; fi\n'
                    f'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then {venv_body}; fi\n'
                    "exit 1\n")
    path.chmod(0o755)
    return path


def make_setup(python: Path, venv: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-C", str(REPO), "setup", f"PY={python}", f"VENV={venv}"],
                          capture_output=True, text=True, timeout=60)


def test_too_old_python_is_named_and_no_venv_is_made(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    python = fake_python(tmp_path, "3.10.12", venv_body=f"mkdir -p {venv}/bin; exit 0")
    result = make_setup(python, venv)
    assert result.returncode != 0
    assert f"{python} is Python 3.10.12" in result.stderr and ">= 3.11" in result.stderr, result.stderr
    assert not venv.exists()


def test_an_interpreter_that_cannot_run_is_named(tmp_path: Path) -> None:
    result = make_setup(tmp_path / "no-such-python", tmp_path / "venv")
    assert result.returncode != 0
    assert "cannot run" in result.stderr and "no-such-python" in result.stderr, result.stderr


def test_failed_setup_removes_the_half_made_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # The version passes; `-m venv` leaves a partial folder behind and fails, as a broken install would.
    python = fake_python(tmp_path, "3.12.1", venv_body=f"mkdir -p {venv}/lib; touch {venv}/pyvenv.cfg; exit 1")
    result = make_setup(python, venv)
    assert result.returncode != 0
    assert "setup failed" in result.stderr, result.stderr
    assert not venv.exists()


def test_serve_installs_only_the_package_and_test_adds_the_extras() -> None:
    dry = {target: subprocess.run(["make", "-C", str(REPO), "-n", "-B", target, "VENV=/nonexistent/venv"],
                                  capture_output=True, text=True, timeout=60).stdout
           for target in ("serve", "generate", "test")}
    for target in ("serve", "generate"):
        assert "pip install --quiet -c constraints.txt -e . " in dry[target] and "[test" not in dry[target], dry[target]
    assert 'pip install --quiet -c constraints.txt -e ".[test,parity]"' in dry["test"]


def test_a_setup_that_works_prints_nothing(tmp_path: Path) -> None:
    """pip 26 passes the build backend's warnings through --quiet; setuptools' editable-install banner is
    one of them. Here a stand-in pip raises that warning as the backend does: the setup must stay silent."""
    venv = made_venv(tmp_path, pip_body=f"exec {sys.executable} -c "
                                         "'import warnings; warnings.warn(\"Editable installation.\", UserWarning)'")
    result = make_setup_in(venv)
    assert result.returncode == 0 and (venv / ".installed-test").exists(), result.stderr
    assert result.stderr == "", result.stderr


def made_venv(tmp_path: Path, pip_body: str = "exit 0") -> Path:
    """A venv as `python -m venv` leaves it, with a stand-in pip: what setup does once the venv exists."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    for script, body in (("python", "exit 0"), ("pip", pip_body)):
        (venv / "bin" / script).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / script).chmod(0o755)
    return venv


def make_setup_in(venv: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-C", str(REPO), "-s", "setup", f"VENV={venv}"], capture_output=True,
                          text=True, timeout=60)


def _import_from_the_folder_holding_a_clone(tmp_path: Path, pythonpath: str) -> subprocess.CompletedProcess[str]:
    parent = tmp_path / "src"
    parent.mkdir(exist_ok=True)
    (parent / "jaxcpp").unlink(missing_ok=True)
    (parent / "jaxcpp").symlink_to(REPO, target_is_directory=True)  # the clone, under its default name
    # The interpreter running the tests has its own venv's path entry (make setup made it): drop it, so
    # that only the entry under test (`pythonpath`) can make the import work.
    code = ("import os, sys; keep = os.environ.get('PYTHONPATH', ''); "
            "sys.path[:] = [p for p in sys.path if p == keep or not p.endswith('jaxcpp-path')]; "
            "from jaxcpp import LLM, SamplingParams; import jaxcpp.models.llama, jaxcpp.serving.client; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=parent, capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": pythonpath} if pythonpath else env)


def test_setup_links_the_package_so_the_folder_holding_the_clone_cannot_hide_it(tmp_path: Path) -> None:
    venv = made_venv(tmp_path)
    result = make_setup_in(venv)
    assert result.returncode == 0, result.stderr
    link = venv / "jaxcpp-path" / "jaxcpp"
    assert link.resolve() == (REPO / "jaxcpp").resolve()
    pth = venv / "lib" / "python3.12" / "site-packages" / "jaxcpp-path.pth"
    assert pth.read_text().strip() == str(venv / "jaxcpp-path")
    # That path entry is what makes `from jaxcpp import LLM` work from the folder holding the clone:
    without = _import_from_the_folder_holding_a_clone(tmp_path, "")
    assert "cannot import name 'LLM' from 'jaxcpp' (unknown location)" in without.stderr, without.stderr
    with_entry = _import_from_the_folder_holding_a_clone(tmp_path, str(venv / "jaxcpp-path"))
    assert with_entry.stdout.strip() == "ok", with_entry.stderr
