"""How the processes of a pipeline find and trust each other: addresses, ports and the control key.

    coordinator   --coordinator-address HOST:PORT   jax.distributed's service, in stage 0's process
    control       HOST:PORT+1                       the head's control channel (HMAC, shared key)
    transfer      ADVERTISE:ephemeral               each stage's jax.experimental.transfer server and its
                                                    bulk sockets, published in the coordinator's store

A stage's transfer server binds the address it advertises, and its outgoing bulk connections bind
it too (jax's socket transport binds the listening address, port 0, before it connects). So that
address must be this host's own, the one other hosts reach it at: `--advertise-address`, else the
address of the interface this host reaches the coordinator through (the coordinator's own address on
the head's host). A loopback address reaches no other host and is reached by none: every stage checks
before the first micro-batch that it can connect from its address to its neighbours' servers, and
a failure names both ends in one line instead of aborting inside jax's transport.

Multi-host control channels authenticate with a key every host shares (`JAXCPP_CONTROL_KEY`); there is
no default key. A head that spawns all its stages on one host makes a random key per run.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from dataclasses import dataclass

from jaxcpp.config import ConfigError, ParallelConfig

CONTROL_KEY_ENV = "JAXCPP_CONTROL_KEY"   # hex; shared by every host, or set by a spawning head
MIN_KEY_BYTES = 16
KEY_HINT = (f"set {CONTROL_KEY_ENV} to the same secret on every host, e.g. "
            f"`export {CONTROL_KEY_ENV}=$(openssl rand -hex 32)` (Kubernetes: from a Secret, see docs/deploy.md)")
CHECK_TIMEOUT_S = 5.0


def shared_control_key() -> bytes:
    """The control channel's key from the environment: required, hex, at least 16 bytes. A key written
    in the source would let anyone who reaches a control port drive the stage."""
    value = os.environ.get(CONTROL_KEY_ENV, "").strip()
    if not value:
        raise ConfigError(f"a multi-host pipeline needs a shared control key: {KEY_HINT}")
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ConfigError(f"{CONTROL_KEY_ENV} must be hex digits: {KEY_HINT}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{CONTROL_KEY_ENV} holds {len(key)} bytes, at least {MIN_KEY_BYTES} are needed: {KEY_HINT}")
    return key


def split_host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Addresses:
    """What one process of a multi-host pipeline connects to and what it publishes."""

    coordinator: str   # host:port of jax.distributed's coordination service
    control: str       # host:port of the head's control channel (the coordinator's port + 1)
    advertise: str     # this host's address: its stage's transfer server binds and publishes it

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Addresses:
        assert parallel.coordinator_address is not None, "multi-host configs have one (ParallelConfig checks)"
        host, port = split_host_port(parallel.coordinator_address)
        advertise = parallel.advertise_address or local_ip_towards(host)
        return cls(parallel.coordinator_address, host_port(host, port + 1), advertise)


def local_ip_towards(host: str) -> str:
    """This host's address on the interface that reaches `host` (the host itself when it is local)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--coordinator-address: cannot resolve {host!r}: {e}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)  # UDP: picks the route and its source address, sends nothing
        except OSError as e:
            raise ConfigError(f"no route from this host to the coordinator host {host!r}: {e}; "
                              "give --advertise-address") from None
        return str(s.getsockname()[0])


def check_local(ip: str) -> None:
    """`ip` must be an address of this host: the transfer server binds it."""
    with socket.socket(_family(ip), socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            raise ConnectionError(f"cannot bind the advertised address {ip}: {e.strerror} (is it an address "
                                  "of this host? check --advertise-address)") from None


def check_reachable(src_ip: str, address: str, what: str, *, wait_s: float = 0.0) -> None:
    """Connect from `src_ip` to `address` (then close), as jax's transport will; retried for `wait_s`
    while refused (the peer may still be starting). Raises ConnectionError naming both ends."""
    host, port = split_host_port(address)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            ip = socket.getaddrinfo(host, port, _family(src_ip), socket.SOCK_STREAM)[0][4][0]
            with socket.socket(_family(src_ip), socket.SOCK_STREAM) as s:
                s.settimeout(CHECK_TIMEOUT_S)
                s.bind((src_ip, 0))
                s.connect((ip, port))
            return
        except OSError as e:
            failure = e
        if failure.errno != errno.ECONNREFUSED or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    reason = failure.strerror or str(failure) or type(failure).__name__
    raise ConnectionError(f"cannot reach {what} at {address} from {src_ip}: {reason}{_loopback_hint(src_ip, host)}")


def is_loopback(host: str) -> bool:
    """A loopback IP address (a name is not resolved: False)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_hint(src_ip: str, host: str) -> str:
    src_loop, dst_loop = is_loopback(src_ip), is_loopback(host)
    if src_loop and not dst_loop:
        return f" ({src_ip} is a loopback address: no other host is reached from it; give --advertise-address)"
    if dst_loop and not src_loop:
        return (f" ({host} is a loopback address: the host that published it must advertise one the others "
                "reach, --advertise-address)")
    return ""


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
