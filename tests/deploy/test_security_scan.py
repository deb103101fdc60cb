"""IaC security scan: checkov passes on every manifest, and every check it skips carries its reason inline.

checkov scans only the kinds it knows, not a LeaderWorkerSet, so each LWS pod template is also scanned as
a Deployment carrying the set's and the template's annotations (where its inline skips live).

checkov pins old versions of packages the engine needs (packaging, networkx, ...), so it lives in a virtual
environment of its own, created on first use next to the test environment: `<venv>/tools/checkov`
(about 290 MB and a few minutes to install; reused afterwards; `make clean` removes it with the venv).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import LWS_KIND, MANIFESTS, load_manifest

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
    out = subprocess.run([str(_checkov_binary()), "--directory", str(root), "--framework", "kubernetes",
                          "--output", "json", "--skip-download", "--soft-fail"],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout)
    results = report["results"] if isinstance(report, dict) else report[0]["results"]
    per_file: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for kind in ("failed", "passed", "skipped"):
        for check in results[f"{kind}_checks"]:
            name = Path(check["file_path"]).name
            per_file.setdefault(name, {"failed": [], "passed": [], "skipped": []})[kind].append(check)
    return per_file


SCANNED = [p.name for p in MANIFESTS] + [f"{p.stem}.lws-templates.yaml" for p in MANIFESTS
                                         if "multi-host" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("name", SCANNED)
def test_checkov_passes(scan, name: str) -> None:
    assert name in scan, f"checkov scanned nothing in {name}"
    if not name.endswith("multi-host.yaml"):  # there, checkov sees only the Service, PDB and NetworkPolicy
        assert len(scan[name]["passed"]) >= 40, "too few checks ran: is it still a workload checkov knows?"
    failed = [f"{c['check_id']} {c['check_name']} ({c['resource']})" for c in scan[name]["failed"]]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCANNED)
def test_every_skipped_check_is_justified_inline(scan, name: str) -> None:
    for check in scan.get(name, {}).get("skipped", []):
        reason = check.get("check_result", {}).get("suppress_comment", "")
        assert len(reason) >= 20, f"{name}: {check['check_id']} skipped without a reason ({reason!r})"


@pytest.mark.slow
def test_checkov_flags_the_negative_control(scan) -> None:
    failed = {c["check_id"] for c in scan["negative-control.yaml"]["failed"]}
    # privileged, root, no liveness/readiness probe, no memory limit, image tag latest
    assert {"CKV_K8S_16", "CKV_K8S_23", "CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_13", "CKV_K8S_14"} <= failed
