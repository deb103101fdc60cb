"""What the deploy tests read: the Dockerfiles and Kubernetes manifests under deploy/, parsed once.

`pod_templates()` flattens every manifest into the pod templates it runs (a Deployment's template, a
LeaderWorkerSet's leader and worker templates), so each check is written once for both kinds.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
LWS_SCHEMA = DEPLOY / "kubernetes" / "schemas" / "leaderworkerset-v1.openapi.yaml"
LWS_KIND = "LeaderWorkerSet"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")  # the built-in kinds with one pod template

# The stage-process flags the multi-host manifests add; `jaxcpp serve` has them, and test_flags.py
# checks them in its parser like every other flag.
ISSUE_10_FLAGS = frozenset({"--distributed-executor-backend", "--coordinator-address", "--num-processes",
                            "--process-id"})
# What LeaderWorkerSet puts in every container's environment, with values like a real group's.
LWS_ENV = {"LWS_LEADER_ADDRESS": "jaxcpp-rocm-pp4-0.jaxcpp-rocm-pp4.jaxcpp", "LWS_GROUP_SIZE": "4",
           "LWS_WORKER_INDEX": "0"}
# ... and what the manifests' env takes from the pod (the downward API's status.podIP).
POD_ENV = {**LWS_ENV, "POD_IP": "10.0.3.17"}


def load_manifest(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


LWS_MANIFESTS = [p for p in MANIFESTS if any(d["kind"] == LWS_KIND for d in load_manifest(p))]


@dataclass(frozen=True)
class PodTemplate:
    manifest: Path
    owner: dict[str, Any]   # the Deployment or LeaderWorkerSet
    role: str               # "deployment", "leader" or "worker"
    template: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.manifest.name}:{self.owner['metadata']['name']}:{self.role}"

    @property
    def spec(self) -> dict[str, Any]:
        return self.template["spec"]

    @property
    def annotations(self) -> dict[str, str]:
        return self.template.get("metadata", {}).get("annotations", {})

    def serve_containers(self) -> list[dict[str, Any]]:
        return [c for c in self.spec["containers"] if c.get("command") == ["jaxcpp", "serve"]]


def pod_templates(path: Path, docs: list[dict[str, Any]] | None = None) -> list[PodTemplate]:
    """The manifest's pod templates; `docs` stands for its objects when given (a test's mutated copy)."""
    found = []
    for doc in load_manifest(path) if docs is None else docs:
        if doc["kind"] in WORKLOAD_KINDS:
            found.append(PodTemplate(path, doc, "deployment", doc["spec"]["template"]))
        elif doc["kind"] == LWS_KIND:
            lwt = doc["spec"]["leaderWorkerTemplate"]
            found.append(PodTemplate(path, doc, "leader", lwt.get("leaderTemplate", lwt["workerTemplate"])))
            found.append(PodTemplate(path, doc, "worker", lwt["workerTemplate"]))
    return found


def all_pod_templates() -> list[PodTemplate]:
    return [t for path in MANIFESTS for t in pod_templates(path)]


def flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag=value` or `--flag value` in args (the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def container_env(container: dict[str, Any], pod: dict[str, str],
                  secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The environment Kubernetes gives `container`: `pod` (what LWS injects, and the pod's own fields by
    their paths, e.g. status.podIP) and its env entries: values, downward-API fields, Secret keys."""
    env = {k: v for k, v in pod.items() if not k.startswith("status.")}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = expand_env(entry["value"], env)
        elif "fieldRef" in source:
            env[entry["name"]] = pod[source["fieldRef"]["fieldPath"]]
        else:
            ref = source["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"], ref["key"]]
    return env


def expand_env(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args."""
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    return arg


# -- Dockerfiles ----------------------------------------------------------------------------------
_CONTINUATION = "\\"


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):  # also inside a continued instruction
            continue
        pending = f"{pending} {stripped.removesuffix(_CONTINUATION).strip()}".strip()
        if not stripped.endswith(_CONTINUATION):
            keyword, _, rest = pending.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            pending = ""
    return instructions


def exec_form(arguments: str) -> list[str]:
    """ENTRYPOINT/CMD arguments: the JSON exec form, else a shell form split like a shell."""
    return json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)


def dockerfile_serve_args(path: Path) -> list[str]:
    """The flags `docker run IMAGE` passes to `jaxcpp serve`: the entry point's after `serve`, then CMD."""
    instructions = dockerfile_instructions(path)
    entrypoint = [exec_form(a) for k, a in instructions if k == "ENTRYPOINT"][-1]
    cmd = [exec_form(a) for k, a in instructions if k == "CMD"][-1]
    assert entrypoint[:2] == ["jaxcpp", "serve"], f"{path.name}: the entry point must be `jaxcpp serve`"
    return entrypoint[2:] + cmd
