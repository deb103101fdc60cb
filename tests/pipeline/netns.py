"""Two hosts made of Linux network namespaces joined by a veth pair, for multi-host tests on real interfaces.

    with TwoHosts.create() as hosts:     # pytest.skip(reason) where namespaces cannot be made
        hosts.popen("a", [...])           # a command inside host a (10.231.77.1) or b (10.231.77.2)
    # on exit, or whatever happens: every process left in either namespace is killed, both removed

Each namespace has its own loopback and one veth end; nothing else (no route to the test's own
namespace), so a process that binds or publishes 127.0.0.1 is cut off from the other host exactly as
on two machines. The addresses are also what the LeaderWorkerSet manifests are checked against
(tests/deploy): a group whose leader pod has HEAD_IP and whose worker pod has STAGE_IP.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from typing import Any

import pytest

from jaxcpp.pipe.cluster import Addresses

HEAD_IP, STAGE_IP = "10.231.77.1", "10.231.77.2"   # host a: the head and stage 0; host b: stage 1
PREFIX_LEN = 24
COORDINATOR_PORT = 8476                            # the manifests' (and jax's customary) port
COORDINATOR = f"{HEAD_IP}:{COORDINATOR_PORT}"


def expected_addresses(process_id: int) -> Addresses:
    """What process `process_id` of the two-host group connects to and advertises."""
    return Addresses(coordinator=COORDINATOR, control=f"{HEAD_IP}:{COORDINATOR_PORT + 1}",
                     advertise=HEAD_IP if process_id == 0 else STAGE_IP)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class TwoHosts:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = {"a": f"jaxcpp-{tag}-a", "b": f"jaxcpp-{tag}-b"}
        self.ips = {"a": HEAD_IP, "b": STAGE_IP}
        self._veth = (f"jx{tag}a", f"jx{tag}b")   # interface names: at most 15 characters

    @classmethod
    def create(cls) -> TwoHosts:
        """Both namespaces with their link up, or pytest.skip naming why they cannot be made here."""
        if shutil.which("ip") is None:
            pytest.skip("multi-host test: no `ip` command (iproute2) to make network namespaces")
        hosts = cls()
        try:
            hosts._make()
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def _make(self) -> None:
        a, b = self.names["a"], self.names["b"]
        first = _ip("netns", "add", a)
        if first.returncode != 0:
            pytest.skip(f"multi-host test: cannot make a network namespace (needs root / CAP_SYS_ADMIN): "
                        f"`ip netns add` said: {first.stderr.strip()}")
        steps = [("netns", "add", b),
                 ("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1]),
                 ("link", "set", self._veth[0], "netns", a), ("link", "set", self._veth[1], "netns", b)]
        for host, veth in zip("ab", self._veth, strict=True):
            ns = self.names[host]
            steps += [("-n", ns, "addr", "add", f"{self.ips[host]}/{PREFIX_LEN}", "dev", veth),
                      ("-n", ns, "link", "set", veth, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                raise RuntimeError(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")

    def command(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]   # ip execs argv: the pid is argv's

    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def run(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.command(host, argv), **kwargs)

    def pids(self, host: str) -> list[int]:
        listed = _ip("netns", "pids", self.names[host])
        return [int(p) for p in listed.stdout.split()] if listed.returncode == 0 else []

    def remove(self) -> None:
        """Kill what still runs in the namespaces (all started by this test), then delete them; deleting
        a namespace deletes its veth end, and with it the pair."""
        for host in ("a", "b"):
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "delete", self.names[host])

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
