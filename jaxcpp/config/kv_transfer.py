"""Disaggregation (prefill on producers, decode on consumers; docs/disaggregation.md): `--kv-transfer-config`
in vLLM's JSON form and `--prefill-servers` (`KVTransferConfig`), parsed into what this instance does
(`KVSettings`)."""

from __future__ import annotations

import functools
import ipaddress
import json
from dataclasses import dataclass

from jaxcpp.config.fields import ConfigError, flag_name, opt, require

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTOR = "JaxTransferConnector"
DEFAULT_KV_IP = "127.0.0.1"  # the command line fills kv_ip from env POD_IP when the JSON leaves it out
# vLLM's other --kv-transfer-config keys, taken so that a vLLM deployment's JSON parses; they mean nothing here
# (a connection is made per producer stage on demand, from the addresses the producer hands out)
_VLLM_KV_KEYS_IGNORED = ("kv_rank", "kv_parallel_size", "kv_port", "kv_buffer_size", "kv_buffer_device", "engine_id")


@dataclass(frozen=True)
class KVSettings:
    """--kv-transfer-config, parsed: what this instance does in a disaggregated deployment."""

    role: str                     # kv_producer, kv_consumer or kv_both
    ip: str                       # the address its KV transfer servers bind and hand out
    transfer_timeout_s: float     # a consumer's wait for its pages; a producer's offer lives this long

    @property
    def produces(self) -> bool:
        return produces(self.role)

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def only_consumes(self) -> bool:
        """A kv_consumer: it never prefills (never chunks dynamically) and pulls into its own process."""
        return self.role == "kv_consumer"


def produces(role: str) -> bool:
    """Whether an instance with this kv_role (as its model info names it) prefills for consumers."""
    return role in ("kv_producer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_transfer_config: str | None = opt(
        None, "prefill-decode disaggregation, in vLLM's JSON form: {\"kv_role\": \"kv_producer\"} prefills for "
        "consumers, \"kv_consumer\" decodes what producers prefilled (with --prefill-servers), \"kv_both\" does "
        "either; optional: \"kv_connector\": \"JaxTransferConnector\" (the only one), \"kv_ip\": the address "
        "its KV transfer servers bind (default: env POD_IP, else 127.0.0.1), \"kv_connector_extra_config\": "
        "{\"transfer_timeout_s\": 60}")
    prefill_servers: str | None = opt(None, "a consumer's producers: gRPC host:port, comma-separated; a host name "
                                      "that resolves to several addresses (a headless Service) is that many "
                                      "producers")

    def __post_init__(self) -> None:
        settings = self.settings()  # parses, naming the bad key
        consumes = settings is not None and settings.consumes
        require(self.prefill_servers is None or consumes, "prefill_servers",
                "is for a consumer: add --kv-transfer-config '{\"kv_role\": \"kv_consumer\"}'")
        require(self.prefill_servers is not None or settings is None or not settings.only_consumes,
                "prefill_servers", "a kv_consumer needs the producers' addresses")
        for server in self.prefill_server_list():
            host, _, port = server.rpartition(":")
            require(bool(host) and port.isdigit(), "prefill_servers", f"expected host:port, got {server!r}")

    def prefill_server_list(self) -> list[str]:
        return [s.strip() for s in (self.prefill_servers or "").split(",") if s.strip()]

    def settings(self) -> KVSettings | None:
        """The parsed --kv-transfer-config, or None when this instance is not disaggregated."""
        return self._parsed

    @functools.cached_property
    def _parsed(self) -> KVSettings | None:  # parsed once (a frozen dataclass keeps a cached_property)
        if self.kv_transfer_config is None:
            return None
        name = "kv_transfer_config"
        try:
            given = json.loads(self.kv_transfer_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag_name(name)}: not JSON ({e}): {self.kv_transfer_config!r}") from None
        require(isinstance(given, dict), name, f"expected a JSON object, got {self.kv_transfer_config!r}")
        known = {"kv_connector", "kv_role", "kv_ip", "kv_connector_extra_config", *_VLLM_KV_KEYS_IGNORED}
        unknown = sorted(set(given) - known)
        require(not unknown, name, f"unknown key(s) {unknown}; known: {sorted(known)}")
        require(given.get("kv_connector", KV_CONNECTOR) == KV_CONNECTOR, name,
                f"kv_connector: only {KV_CONNECTOR!r} (KV pages over jax.experimental.transfer), got "
                f"{given.get('kv_connector')!r}")
        role = given.get("kv_role")
        require(role in KV_ROLES, name, f"kv_role: one of {', '.join(KV_ROLES)}, got {role!r}")
        ip = given.get("kv_ip") or DEFAULT_KV_IP
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError(f"{flag_name(name)}: kv_ip: an IP address of this host is needed (its transfer "
                              f"servers bind it), got {ip!r}") from None
        extra = given.get("kv_connector_extra_config") or {}
        require(isinstance(extra, dict) and set(extra) <= {"transfer_timeout_s"}, name,
                f"kv_connector_extra_config: takes only transfer_timeout_s, got {extra!r}")
        timeout = extra.get("transfer_timeout_s", 60.0)
        require(isinstance(timeout, (int, float)) and timeout > 0, name,
                f"kv_connector_extra_config.transfer_timeout_s: seconds > 0, got {timeout!r}")
        return KVSettings(role, ip, float(timeout))
