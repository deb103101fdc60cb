"""IaC security scan: checkov passes on every manifest and both Dockerfiles, and skips exactly the checks
their inline annotations skip, each with its reason.

checkov scans only the kinds it knows, not a LeaderWorkerSet, so each LWS pod template is also scanned as
a Deployment carrying the set's and the template's annotations (where its inline skips live).

checkov pins old versions of packages the engine needs (packaging, networkx, ...), so it lives in a virtual
environment of its own, created on first use next to the test environment: `<venv>/tools/checkov`
(about 290 MB and a few minutes to install; reused afterwards; `make clean` removes it with the venv).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DOCKERFILES, LWS_KIND, LWS_MANIFESTS, MANIFESTS, WORKLOAD_KINDS, load_manifest

CHECKOV = "checkov==3.3.30"
TOOL_VENV = Path(sys.prefix) / "tools" / "checkov"
INSTALL_TIMEOUT_S = 1200


def _checkov_binary() -> Path:
    binary = TOOL_VENV / "bin" / "checkov"
    stamp = TOOL_VENV / f".{CHECKOV}"
    if not stamp.exists():
        shutil.rmtree(TOOL_VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(TOOL_VENV)], check=True, timeout=120)
        subprocess.run([str(TOOL_VENV / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                        CHECKOV], check=True, timeout=INSTALL_TIMEOUT_S)
        stamp.touch()
    return binary


def _lws_templates_as_deployments(doc: dict[str, Any]) -> list[dict[str, Any]]:
    lwt = doc["spec"]["leaderWorkerTemplate"]
    found = []
    for role in ("leaderTemplate", "workerTemplate"):
        if role not in lwt:
            continue
        template = lwt[role]
        annotations = {**doc["metadata"].get("annotations", {}), **template["metadata"].get("annotations", {})}
        found.append({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": f"{doc['metadata']['name']}-{role}",
                                   "namespace": doc["metadata"]["namespace"], "annotations": annotations},
                      "spec": {"selector": {"matchLabels": template["metadata"]["labels"]},
                               "template": template}})
    return found


BAD_DEPLOYMENT = {  # the negative control: root, privileged, no probes, no limits
    "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "bad", "namespace": "jaxcpp"},
    "spec": {"selector": {"matchLabels": {"app": "bad"}}, "template": {
        "metadata": {"labels": {"app": "bad"}},
        "spec": {"containers": [{"name": "bad", "image": "bad:latest", "securityContext": {"privileged": True}}]}}}}


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """checkov's results per scanned file name: {"failed": [...], "passed": [...], "skipped": [...]}."""
    root = tmp_path_factory.mktemp("checkov")
    for path in MANIFESTS:
        shutil.copy(path, root / path.name)
        for doc in load_manifest(path):
            if doc["kind"] == LWS_KIND:
                wrapped = _lws_templates_as_deployments(doc)
                (root / f"{path.stem}.lws-templates.yaml").write_text(yaml.safe_dump_all(wrapped))
    (root / "negative-control.yaml").write_text(yaml.safe_dump(BAD_DEPLOYMENT))
    for path in DOCKERFILES:
        shutil.copy(path, root / path.name)
    out = subprocess.run([str(_checkov_binary()), "--directory", str(root), "--framework", "kubernetes",
                          "dockerfile", "--output", "json", "--skip-download", "--soft-fail"],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    per_file: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for results in (r["results"] for r in reports):
        for kind in ("failed", "passed", "skipped"):
            for check in results[f"{kind}_checks"]:
                name = Path(check["file_path"]).name
                per_file.setdefault(name, {"failed": [], "passed": [], "skipped": []})[kind].append(check)
    for name in SCANNED:  # what checkov read and skipped: the annotations' text, seen by the tests below
        per_file.setdefault(name, {"failed": [], "passed": [], "skipped": []})["text"] = (root / name).read_text()
    return per_file


SCANNED = ([p.name for p in MANIFESTS] + [f"{p.stem}.lws-templates.yaml" for p in LWS_MANIFESTS]
           + [p.name for p in DOCKERFILES])
# Manifests whose only workload is a LeaderWorkerSet: raw, checkov sees just their Service, PDB and NetworkPolicy.
WITHOUT_WORKLOAD_CHECKOV_KNOWS = {p.name for p in MANIFESTS
                                  if not any(d["kind"] in WORKLOAD_KINDS for d in load_manifest(p))}
INLINE_SKIP = re.compile(r"checkov\.io/skip\d+:\s*(CKV_\w+)=|checkov:skip=(CKV_\w+)")


def expected_skips(name: str, text: str) -> set[str]:
    """The checks the file's inline annotations skip, on the kinds checkov scans: in a raw manifest, those
    of every object but a LeaderWorkerSet, whose skips checkov reads only through the .lws-templates copy."""
    if name in {p.name for p in MANIFESTS}:
        text = yaml.safe_dump_all([d for d in yaml.safe_load_all(text) if d and d["kind"] != LWS_KIND])
    return {a or b for a, b in INLINE_SKIP.findall(text)}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCANNED)
def test_checkov_passes(scan, name: str) -> None:
    assert scan[name]["passed"], f"checkov scanned nothing in {name}"
    if name not in WITHOUT_WORKLOAD_CHECKOV_KNOWS:
        assert len(scan[name]["passed"]) >= 40, "too few checks ran: is it still a workload checkov knows?"
    failed = [f"{c['check_id']} {c['check_name']} ({c['resource']})" for c in scan[name]["failed"]]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCANNED)
def test_checkov_skips_exactly_the_inline_skips_each_with_its_reason(scan, name: str) -> None:
    skipped = scan[name]["skipped"]
    assert {c["check_id"] for c in skipped} == expected_skips(name, scan[name]["text"])
    reasons = {c["check_id"]: c.get("check_result", {}).get("suppress_comment", "") for c in skipped}
    assert all(len(r) >= 20 for r in reasons.values()), f"{name}: skipped without a reason: {reasons}"


@pytest.mark.slow
def test_checkov_flags_the_negative_control(scan) -> None:
    failed = {c["check_id"] for c in scan["negative-control.yaml"]["failed"]}
    # privileged, root, no liveness/readiness probe, no memory limit, image tag latest
    assert {"CKV_K8S_16", "CKV_K8S_23", "CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_13", "CKV_K8S_14"} <= failed
