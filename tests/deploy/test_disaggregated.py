"""The prefill-decode disaggregated manifests: producers (a LeaderWorkerSet that prefills, with dynamic
chunking) and consumers (a Deployment that decodes and takes the clients), checked against each other
and the real CLI: the roles, --prefill-servers naming the producers' headless Service and port, dynamic
chunking on the producer side only, the address the transfer servers bind, one page layout on both
sides, and the network paths the NetworkPolicies leave open between them."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jaxcpp.cli_args import engine_config_from_args, server_config_from_args
from jaxcpp.config import EngineConfig, KVSettings, ServerConfig
from tests.deploy.conftest import (
    LWS_ENV,
    LWS_KIND,
    MANIFESTS,
    PodTemplate,
    container_env,
    expand_env,
    flag_value,
    load_manifest,
    pod_templates,
)
from tests.deploy.test_flags import _serve_parser

DISAGGREGATED = [p for p in MANIFESTS if "disaggregated" in p.name]
POD_IP = "10.0.3.17"
EPHEMERAL_PORTS = (32768, 45000, 60999)  # Linux's ip_local_port_range, where the transfer servers listen
OUTSIDE = None  # a client outside the pod network's selected pods (no labels any policy admits)


@dataclass(frozen=True)
class Roles:
    docs: list[dict[str, Any]]
    leader: PodTemplate     # a producer group's head: the engine and gRPC, stage 0
    worker: PodTemplate     # the group's other stages
    consumer: PodTemplate

    @property
    def producers(self) -> list[PodTemplate]:
        return [self.leader, self.worker]

    @property
    def templates(self) -> list[PodTemplate]:
        return [self.leader, self.worker, self.consumer]


def _roles(docs: list[dict[str, Any]], path: Path) -> Roles:
    templates = pod_templates(path, docs)
    by_role = {(t.owner["kind"], t.role): t for t in templates}
    assert len(templates) == 3 and set(by_role) == {(LWS_KIND, "leader"), (LWS_KIND, "worker"),
                                                    ("Deployment", "deployment")}
    return Roles(docs, by_role[LWS_KIND, "leader"], by_role[LWS_KIND, "worker"], by_role["Deployment", "deployment"])


def _container(template: PodTemplate) -> dict[str, Any]:
    [container] = template.serve_containers()
    return container


def _args(template: PodTemplate) -> list[str]:
    return [expand_env(a, {**LWS_ENV, "POD_IP": POD_IP}) for a in _container(template)["args"]]


def _engine(template: PodTemplate) -> EngineConfig:
    return engine_config_from_args(_serve_parser().parse_args(_args(template)))


def _server(template: PodTemplate) -> ServerConfig:
    return server_config_from_args(_serve_parser().parse_args(_args(template)))


def _kv(template: PodTemplate) -> KVSettings:
    settings = _engine(template).kv_transfer.settings()
    assert settings is not None, f"{template.id}: no --kv-transfer-config"
    return settings


def _flag(template: PodTemplate, flag: str) -> str:
    value = flag_value(_args(template), flag)
    assert value is not None, f"{template.id}: no {flag}"
    return value


def _labels(template: PodTemplate) -> dict[str, str]:
    return template.template["metadata"]["labels"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


ROLES = [pytest.param(_roles(load_manifest(p), p), id=p.name) for p in DISAGGREGATED]


def test_both_vendors_have_one() -> None:
    assert [p.name for p in DISAGGREGATED] == ["cuda-disaggregated.yaml", "rocm-disaggregated.yaml"]


@pytest.mark.parametrize("roles", ROLES)
def test_producers_produce_and_consumers_consume(roles: Roles) -> None:
    for producer in roles.producers:
        assert _kv(producer).role == "kv_producer", producer.id
    assert _kv(roles.consumer).role == "kv_consumer"


@pytest.mark.parametrize("roles", ROLES)
def test_dynamic_chunking_is_on_the_producers_only(roles: Roles) -> None:
    """Producers prefill, so they chunk; a consumer would refuse it with a warning: it is not asked for."""
    for producer in roles.producers:
        assert _engine(producer).dynamic_chunking, producer.id
    assert not any(a.startswith("--enable-dynamic-chunking") for a in _args(roles.consumer))
    assert not _engine(roles.consumer).chunking.enable_dynamic_chunking


@pytest.mark.parametrize("roles", ROLES)
def test_both_roles_hold_pages_of_one_layout(roles: Roles) -> None:
    """The pages move as they are: same model, dtype, length, page size and page dtype on both sides."""
    producer, consumer = _engine(roles.leader), _engine(roles.consumer)
    assert producer.model == consumer.model
    assert (producer.cache.page_size, producer.cache.kv_cache_dtype) == (consumer.cache.page_size,
                                                                         consumer.cache.kv_cache_dtype)
    assert consumer.parallel.pipeline_parallel_size == 1 and consumer.parallel.executor_backend == "inproc"


def prefill_server_problems(roles: Roles) -> list[str]:
    """Why the consumer's --prefill-servers would not list every ready producer (empty: it does)."""
    namespace = roles.consumer.owner["metadata"]["namespace"]
    services = {d["metadata"]["name"]: d for d in roles.docs if d["kind"] == "Service"}
    leader_port = int(_flag(roles.leader, "--port"))
    named_ports = {p["name"]: p["containerPort"] for p in _container(roles.leader)["ports"]}
    servers = _engine(roles.consumer).kv_transfer.prefill_server_list()
    problems = [] if len(servers) == 1 else [f"expected the one Service, got {servers}"]
    for server in servers:
        host, port = server.rsplit(":", 1)
        name, _, domain = host.partition(".")
        if domain not in ("", namespace, f"{namespace}.svc") and not domain.startswith(f"{namespace}.svc."):
            problems.append(f"{host}: not a Service of namespace {namespace}")
        service = services.get(name)
        if service is None:
            problems.append(f"{host}: no such Service in the manifest")
            continue
        spec = service["spec"]
        if spec.get("clusterIP") != "None":
            problems.append(f"{name}: not headless, so one virtual IP hides all producers but one")
        if spec.get("publishNotReadyAddresses"):
            problems.append(f"{name}: lists producers that are not ready")
        if not _selects(spec["selector"], _labels(roles.leader)):
            problems.append(f"{name}: does not select the producers' leaders")
        if any(_selects(spec["selector"], _labels(t)) for t in (roles.worker, roles.consumer)):
            problems.append(f"{name}: selects pods that are not producer leaders")
        # A headless Service maps no port: the consumer dials the leader's own port.
        targets = [p.get("targetPort", p["port"]) for p in spec["ports"] if p["port"] == int(port)]
        if [named_ports.get(t, t) for t in targets] != [leader_port]:
            problems.append(f"{server}: port {port} is not the leaders' gRPC port {leader_port}")
    return problems


@pytest.mark.parametrize("roles", ROLES)
def test_prefill_servers_name_the_producers_headless_service(roles: Roles) -> None:
    assert prefill_server_problems(roles) == []


def _with_consumer_arg(flag: str, value: str) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(docs: list[dict[str, Any]]) -> None:
        [deployment] = [d for d in docs if d["kind"] == "Deployment"]
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        container["args"] = [a for a in container["args"] if not a.startswith(flag + "=")] + [f"{flag}={value}"]
    return mutate


def _service(docs: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    [service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith(suffix)]
    return service


@pytest.mark.parametrize("mutate", [
    _with_consumer_arg("--prefill-servers", "jaxcpp-rocm-prefill:50051"),  # the set's own headless Service
    _with_consumer_arg("--prefill-servers", "jaxcpp-rocm-prefill-leaders:50052"),
    _with_consumer_arg("--prefill-servers", "jaxcpp-rocm-prefill-leaders.other:50051"),
    lambda docs: _service(docs, "-leaders")["spec"].pop("clusterIP"),
    lambda docs: _service(docs, "-leaders")["spec"].update(publishNotReadyAddresses=True),
    lambda docs: _service(docs, "-leaders")["spec"]["selector"].pop("app.kubernetes.io/component"),
], ids=["lws-own-service", "wrong-port", "other-namespace", "not-headless", "not-ready-listed", "selects-workers"])
def test_a_wrong_prefill_servers_is_caught(mutate: Callable[[list[dict[str, Any]]], Any]) -> None:
    path = next(p for p in DISAGGREGATED if p.name.startswith("rocm"))
    docs = copy.deepcopy(load_manifest(path))
    mutate(docs)
    assert prefill_server_problems(_roles(docs, path))


@pytest.mark.parametrize("roles", ROLES)
def test_transfer_servers_bind_the_pod_ip(roles: Roles, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_ip is left to its default, env POD_IP, which the downward API sets to each pod's own address
    (the same args run on every pod of a group, so no one kv_ip could be right for all of them)."""
    secret = {("jaxcpp-control-key", "key"): "00" * 32}
    for template in roles.templates:
        given = json.loads(_flag(template, "--kv-transfer-config"))
        assert "kv_ip" not in given, template.id
        lws = LWS_ENV if template.owner["kind"] == LWS_KIND else {}
        env = container_env(_container(template), {**lws, "status.podIP": POD_IP}, secret)
        assert env["POD_IP"] == POD_IP, template.id
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            assert _kv(template).ip == POD_IP, template.id
            patch.delenv("POD_IP")
            assert _kv(template).ip == "127.0.0.1", "the test reads the env it set"


@pytest.mark.parametrize("roles", ROLES)
def test_clients_reach_the_consumers_only(roles: Roles) -> None:
    consumer = _server(roles.consumer)
    assert consumer.enable_grpc and consumer.enable_http
    ports = {p["name"]: p["containerPort"] for p in _container(roles.consumer)["ports"]}
    assert (ports["grpc"], ports["http"]) == (consumer.port, consumer.http_port)
    entries = [d for d in roles.docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"]
    [entry] = entries
    assert _selects(entry["spec"]["selector"], _labels(roles.consumer))
    assert {p["targetPort"] for p in entry["spec"]["ports"]} >= {"grpc", "http"}
    assert not any(_selects(entry["spec"]["selector"], _labels(t)) for t in roles.producers)
    assert not _server(roles.leader).enable_http, "producers serve consumers only, over gRPC"


# -- network paths ---------------------------------------------------------------------------------
def ingress_allowed(docs: list[dict[str, Any]], to: dict[str, str], source: dict[str, str] | None, port: int) -> bool:
    """Whether the docs' NetworkPolicies admit TCP to `port` of a pod labelled `to` from a pod of the
    namespace labelled `source` (None: from outside it). Covers what the manifests use: podSelector
    matchLabels peers, plain ports."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
                and _selects(d["spec"]["podSelector"]["matchLabels"], to)]
    if not policies:
        return True
    for rule in (r for p in policies for r in p["spec"].get("ingress", [])):
        peers = rule.get("from")
        assert all(set(peer) == {"podSelector"} and set(peer["podSelector"]) == {"matchLabels"}
                   for peer in peers or []), "a peer kind this check does not model"
        from_ok = peers is None or (source is not None and any(
            _selects(peer["podSelector"]["matchLabels"], source) for peer in peers))
        port_ok = "ports" not in rule or any(p["port"] == port and p.get("protocol", "TCP") == "TCP"
                                             for p in rule["ports"])
        if from_ok and port_ok:
            return True
    return False


@pytest.mark.parametrize("roles", ROLES)
def test_network_policies_let_the_roles_reach_each_other_on_any_port(roles: Roles) -> None:
    """The consumers call the producers' gRPC and pull pages from every stage's transfer server; the
    transfers' ports are ephemeral, so the roles must reach each other on all ports, both ways."""
    docs, consumer = roles.docs, _labels(roles.consumer)
    grpc = int(_flag(roles.leader, "--port"))
    for producer in (_labels(t) for t in roles.producers):
        assert ingress_allowed(docs, producer, consumer, grpc)
        for port in EPHEMERAL_PORTS:
            assert ingress_allowed(docs, producer, consumer, port)
            assert ingress_allowed(docs, consumer, producer, port)
            assert ingress_allowed(docs, producer, _labels(roles.leader), port)  # inside a group
            assert ingress_allowed(docs, _labels(roles.leader), producer, port)


@pytest.mark.parametrize("roles", ROLES)
def test_network_policies_keep_everyone_else_to_the_api_and_metrics(roles: Roles) -> None:
    docs, consumer = roles.docs, _labels(roles.consumer)
    server = _server(roles.consumer)
    metrics = int(_flag(roles.consumer, "--metrics-port"))
    other_app = {"app.kubernetes.io/name": "jaxcpp", "app.kubernetes.io/instance": "jaxcpp-rocm"}  # single node
    for source in (OUTSIDE, other_app):
        for port in (server.port, server.http_port, metrics):
            assert ingress_allowed(docs, consumer, source, port)
        for producer in (_labels(t) for t in roles.producers):
            assert ingress_allowed(docs, producer, source, metrics)
            assert not ingress_allowed(docs, producer, source, int(_flag(roles.leader, "--port")))
            assert not any(ingress_allowed(docs, producer, source, p) for p in EPHEMERAL_PORTS)
        assert not any(ingress_allowed(docs, consumer, source, p) for p in EPHEMERAL_PORTS)


def test_a_policy_that_admits_only_the_producers_own_pods_is_caught() -> None:
    path = next(p for p in DISAGGREGATED if p.name.startswith("rocm"))
    docs = copy.deepcopy(load_manifest(path))
    roles = _roles(docs, path)
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-prefill")]
    policy["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"] = {
        "app.kubernetes.io/instance": roles.leader.owner["metadata"]["name"]}
    assert not ingress_allowed(docs, _labels(roles.leader), _labels(roles.consumer), EPHEMERAL_PORTS[0])
    assert ingress_allowed(docs, _labels(roles.leader), _labels(roles.worker), EPHEMERAL_PORTS[0])
