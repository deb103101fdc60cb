"""The Kubernetes manifests: every object validates (strictly: unknown fields fail) against the Kubernetes
schemas of kubernetes-validate, the LeaderWorkerSet against its CRD's schema shipped in
deploy/kubernetes/schemas/ (with jsonschema) and its pod templates against core/v1; and the pieces agree
with each other and with the server (probe ports, grace periods, the LWS group, GPUs, volumes)."""

from __future__ import annotations

import copy
import dataclasses
import re
import secrets
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from jaxcpp.cli_args import engine_config_from_args
from jaxcpp.pipe.cluster import Addresses, shared_control_key
from jaxcpp.serving.server import SERVICE_NAME
from tests.deploy.conftest import (
    LWS_ENV,
    LWS_KIND,
    LWS_MANIFESTS,
    LWS_SCHEMA,
    MANIFESTS,
    PodTemplate,
    all_pod_templates,
    container_env,
    expand_env,
    flag_value,
    load_manifest,
    pod_templates,
)
from tests.deploy.test_flags import _serve_parser
from tests.pipeline.netns import HEAD_IP, STAGE_IP, expected_addresses

# The oldest Kubernetes the manifests claim (gRPC probes GA in 1.27, preStop sleep beta in 1.30) and the
# newest kubernetes-validate has schemas for.
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
GPU_RESOURCE = {"rocm": "amd.com/gpu", "cuda": "nvidia.com/gpu"}
TEMPLATES = all_pod_templates()
TEMPLATE_IDS = [t.id for t in TEMPLATES]


def _objects() -> list:
    return [pytest.param(path, doc, id=f"{path.name}:{doc['kind']}:{doc['metadata']['name']}")
            for path in MANIFESTS for doc in load_manifest(path)]


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object that lists its properties (strict)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


LWS_VALIDATOR = jsonschema.Draft202012Validator(
    _closed(yaml.safe_load(LWS_SCHEMA.read_text())["openAPIV3Schema"]))


def _validate_lws(doc: dict[str, Any], version: str) -> None:
    LWS_VALIDATOR.validate(doc)
    lwt = doc["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        if role in lwt:
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": f"{doc['metadata']['name']}-{role}"}, "template": lwt[role]}
            kubernetes_validate.validate(pod_template, version, strict=True)


def _validate(doc: dict[str, Any], version: str) -> None:
    if doc["kind"] == LWS_KIND:
        _validate_lws(doc, version)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def _container(template: PodTemplate) -> dict[str, Any]:
    [container] = template.serve_containers()
    return container


def _target(path: Path) -> str:
    return path.name.split("-")[0]


def _manifest(name: str) -> Path:
    [path] = [p for p in MANIFESTS if p.name == name]
    return path


def _labels(template: PodTemplate) -> dict[str, str]:
    return template.template["metadata"]["labels"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def _lws_templates(path: Path) -> list[PodTemplate]:
    """The leader's and the worker's template of the manifest's one LeaderWorkerSet, in that order."""
    return [t for t in pod_templates(path) if t.owner["kind"] == LWS_KIND]


# -- schemas ---------------------------------------------------------------------------------------
def test_all_six_manifests_are_there() -> None:
    assert [p.name for p in MANIFESTS] == ["cuda-disaggregated.yaml", "cuda-multi-host.yaml", "cuda-single-node.yaml",
                                           "rocm-disaggregated.yaml", "rocm-multi-host.yaml", "rocm-single-node.yaml"]
    assert [p.name for p in LWS_MANIFESTS] == ["cuda-disaggregated.yaml", "cuda-multi-host.yaml",
                                               "rocm-disaggregated.yaml", "rocm-multi-host.yaml"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("path", "doc"), _objects())
def test_object_validates_against_its_schema(path: Path, doc: dict[str, Any], version: str) -> None:
    _validate(doc, version)


def test_a_misspelt_field_fails_validation() -> None:
    deployment = next(d for d in load_manifest(_manifest("cuda-single-node.yaml")) if d["kind"] == "Deployment")
    bad = copy.deepcopy(deployment)
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("mutate", [
    lambda lws: lws["spec"]["leaderWorkerTemplate"].update(restartPolcy="RecreateGroupOnPodRestart"),
    lambda lws: lws["spec"]["leaderWorkerTemplate"].update(restartPolicy="RestartEverything"),
    lambda lws: lws["spec"]["leaderWorkerTemplate"].update(size="four"),
    lambda lws: lws["spec"]["leaderWorkerTemplate"].pop("workerTemplate"),
    lambda lws: lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].update(terminationGracePeriod=75),
], ids=["misspelt-field", "unknown-restart-policy", "size-not-integer", "no-worker-template",
        "bad-pod-template"])
def test_a_broken_leaderworkerset_fails_validation(mutate) -> None:
    lws = next(d for d in load_manifest(_manifest("cuda-multi-host.yaml")) if d["kind"] == LWS_KIND)
    bad = copy.deepcopy(lws)
    mutate(bad)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        _validate(bad, K8S_VERSIONS[0])


# -- the pieces agree ------------------------------------------------------------------------------
def test_rocm_and_cuda_manifests_differ_only_in_the_gpu_vendor() -> None:
    """Written twice for `kubectl apply -f` without a renderer; this keeps the twins in step."""
    for rocm in (p for p in MANIFESTS if _target(p) == "rocm"):
        cuda = rocm.with_name(rocm.name.replace("rocm", "cuda"))
        text = rocm.read_text().replace("amd.com/gpu", "nvidia.com/gpu").replace("rocm", "cuda")
        expected = [_without_supplemental_groups(d) for d in yaml.safe_load_all(text) if d]
        assert expected == load_manifest(cuda), f"{cuda.name} drifted from {rocm.name}"


def _without_supplemental_groups(doc: Any) -> Any:  # ROCm's device nodes need the video/render groups
    if isinstance(doc, dict):
        return {k: _without_supplemental_groups(v) for k, v in doc.items() if k != "supplementalGroups"}
    if isinstance(doc, list):
        return [_without_supplemental_groups(v) for v in doc]
    return doc


@pytest.mark.parametrize("template", TEMPLATES, ids=TEMPLATE_IDS)
def test_probes_use_the_grpc_health_service_on_the_served_port(template: PodTemplate) -> None:
    container = _container(template)
    probes = {name: container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")
              if name in container}
    if template.role == "worker":
        assert not probes  # stage processes serve nothing (the checkov skips say why)
        return
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}
    port = int(flag_value(container["args"], "--port"))
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named["grpc"] == port
    for name, probe in probes.items():
        assert probe["grpc"]["port"] == port, f"{name} probes {probe['grpc']['port']}, the server is on {port}"
        assert probe["grpc"].get("service", "") in ("", SERVICE_NAME)  # what the server's health knows
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, "allow >= 20 min of warm-up"


@pytest.mark.parametrize("template", TEMPLATES, ids=TEMPLATE_IDS)
def test_termination_grace_outlasts_the_drain(template: PodTemplate) -> None:
    container = _container(template)
    drain = float(flag_value(container["args"], "--shutdown-grace-s"))
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    # + 10 s for stopping the engine thread (and, multi-host, the stages) after the drain
    assert template.spec["terminationGracePeriodSeconds"] >= drain + pre_stop + 10


@pytest.mark.parametrize("template", [t for t in TEMPLATES if t.role != "worker"],
                         ids=[t.id for t in TEMPLATES if t.role != "worker"])
def test_prometheus_scrapes_the_metrics_port(template: PodTemplate) -> None:
    container = _container(template)
    metrics_port = int(flag_value(container["args"], "--metrics-port"))
    assert template.annotations["prometheus.io/scrape"] == "true"
    assert int(template.annotations["prometheus.io/port"]) == metrics_port
    assert {"name": "metrics", "containerPort": metrics_port} in container["ports"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_services_reach_heads_only_and_one_pdb_covers_each_workload(path: Path) -> None:
    docs = load_manifest(path)
    services = [d for d in docs if d["kind"] == "Service"]
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    templates = pod_templates(path)
    for service in services:
        selected = [t for t in templates if _selects(service["spec"]["selector"], _labels(t))]
        assert selected, f"{service['metadata']['name']} selects no pod"
        assert all(t.role != "worker" for t in selected), "stages take no traffic: a Service selects heads only"
        for head in selected:
            ports = {p["name"] for p in _container(head)["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    for template in templates:
        if template.role != "worker":
            assert any(_selects(s["spec"]["selector"], _labels(template)) for s in services), template.id
        # The eviction API refuses to evict a pod under two budgets; one budget per workload lets a drain
        # take a pod of each workload at once, never two of one.
        [pdb] = [p for p in pdbs if _selects(p["spec"]["selector"]["matchLabels"], _labels(template))]
        others = [t for t in templates if t.owner is not template.owner]
        assert not any(_selects(pdb["spec"]["selector"]["matchLabels"], _labels(t)) for t in others), template.id


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_no_service_takes_the_name_of_a_leaderworkerset(path: Path) -> None:
    """LeaderWorkerSet creates a headless Service named after the set (it gives the pods the DNS names
    LWS_LEADER_ADDRESS is one of) only when no Service of that name exists: ours, applied first, would
    leave the leader's name unresolved; applied second, it would be merged into the set's."""
    docs = load_manifest(path)
    sets = {d["metadata"]["name"] for d in docs if d["kind"] == LWS_KIND}
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert not sets & services


@pytest.mark.parametrize("template", TEMPLATES, ids=TEMPLATE_IDS)
def test_gpus_match_the_parallel_layout(template: PodTemplate) -> None:
    container = _container(template)
    args = container["args"]
    pp, tp = int(flag_value(args, "--pipeline-parallel-size")), int(flag_value(args, "--tensor-parallel-size"))
    per_pod = tp if template.owner["kind"] == LWS_KIND else pp * tp  # multi-host: one stage per pod
    resource = GPU_RESOURCE[_target(template.manifest)]
    for section in ("requests", "limits"):
        assert int(container["resources"][section][resource]) == per_pod
        assert {"cpu", "memory"} <= container["resources"][section].keys()
    other = set(GPU_RESOURCE.values()) - {resource}
    assert not other & container["resources"]["limits"].keys()
    platform = {e["name"]: e.get("value") for e in container["env"]}["JAX_PLATFORMS"]
    assert platform == _target(template.manifest)


@pytest.mark.parametrize("path", LWS_MANIFESTS, ids=lambda p: p.name)
def test_leaderworkerset_group_is_the_pipeline(path: Path) -> None:
    [lws] = [d for d in load_manifest(path) if d["kind"] == LWS_KIND]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (_container(t) for t in _lws_templates(path))
    assert leader["args"] == worker["args"], "the same command on every host; --process-id picks the role"
    assert lwt["size"] == int(flag_value(leader["args"], "--pipeline-parallel-size")), "one stage per pod"
    assert re.fullmatch(r"\$\(LWS_LEADER_ADDRESS\):\d+", flag_value(leader["args"], "--coordinator-address"))
    assert flag_value(leader["args"], "--num-processes") == "$(LWS_GROUP_SIZE)"
    assert flag_value(leader["args"], "--process-id") == "$(LWS_WORKER_INDEX)"
    coordinator_port = int(flag_value(leader["args"], "--coordinator-address").rsplit(":", 1)[1])
    assert {"name": "coordinator", "containerPort": coordinator_port} in leader["ports"]


@pytest.mark.parametrize("path", LWS_MANIFESTS, ids=lambda p: p.name)
def test_leaderworkerset_pods_get_the_addresses_of_the_two_host_test(path: Path, monkeypatch) -> None:
    """Expanded as Kubernetes does in a group whose leader pod has the two-host test's head address and
    whose worker pod has its stage address (tests/pipeline/test_multi_host.py), the flags and env give
    each process the coordinator, control channel and advertised address that test runs with; and both
    take the control key from one Secret, the one the manifest's header tells how to make."""
    leader_name = LWS_ENV["LWS_LEADER_ADDRESS"]  # LWS's headless-Service name: it resolves to the leader's pod IP
    secret = {("jaxcpp-control-key", "key"): secrets.token_hex(32)}
    keys = []
    leader, worker = _lws_templates(path)
    for process_id, template, pod_ip in ((0, leader, HEAD_IP), (1, worker, STAGE_IP)):
        container = _container(template)
        pod = {**LWS_ENV, "LWS_WORKER_INDEX": str(process_id), "status.podIP": pod_ip}
        env = container_env(container, pod, secret)
        args = [expand_env(a, env) for a in container["args"]]
        parallel = engine_config_from_args(_serve_parser().parse_args(args)).parallel
        got = Addresses.of(parallel)
        resolved = dataclasses.replace(got, coordinator=got.coordinator.replace(leader_name, HEAD_IP),
                                       control=got.control.replace(leader_name, HEAD_IP))
        assert resolved == expected_addresses(process_id), template.id
        monkeypatch.setenv("JAXCPP_CONTROL_KEY", env["JAXCPP_CONTROL_KEY"])
        keys.append(shared_control_key())
        refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "JAXCPP_CONTROL_KEY"]
        assert refs == [{"name": "jaxcpp-control-key", "key": "key"}], template.id
    assert keys[0] == keys[1], "every pod of the group shares the key"
    assert ("kubectl -n jaxcpp create secret generic jaxcpp-control-key --from-literal=key=$(openssl rand -hex 32)"
            in path.read_text())


@pytest.mark.parametrize("template", TEMPLATES, ids=TEMPLATE_IDS)
def test_volumes_for_model_cache_and_shm(template: PodTemplate) -> None:
    container = _container(template)
    volumes = {v["name"]: v for v in template.spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    model = flag_value(container["args"], "--model")
    models = mounts["/models"]
    assert model.startswith("/models/") and models["readOnly"] is True
    assert "persistentVolumeClaim" in volumes[models["name"]]
    cache_mount = next(m for path, m in mounts.items() if env["JAXCPP_COMPILATION_CACHE_DIR"].startswith(path + "/"))
    assert "persistentVolumeClaim" in volumes[cache_mount["name"]], "the compilation cache must outlive the pod"
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"].endswith("Gi") and int(shm["sizeLimit"][:-2]) >= 8
    assert "/tmp" in mounts, "a writable /tmp, since the root filesystem is read-only"


@pytest.mark.parametrize("template", TEMPLATES, ids=TEMPLATE_IDS)
def test_containers_are_locked_down(template: PodTemplate) -> None:
    pod = template.spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] >= 10000
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    assert template.spec["automountServiceAccountToken"] is False
    for container in template.spec["containers"]:
        ctx = container["securityContext"]
        assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
        assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"] == {"drop": ["ALL"]}
