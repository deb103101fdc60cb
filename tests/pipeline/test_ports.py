"""free_port: ports for servers that stage processes bind seconds later, drawn clear of outgoing connections."""

from __future__ import annotations

import socket

from jaxcpp.head import supervision
from jaxcpp.head.supervision import ephemeral_ports, free_port


def test_free_ports_come_from_below_the_ephemeral_range_and_bind():
    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(10000 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_the_range_is_read_from_the_kernel_or_defaults_to_linuxs(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_ports(str(path)) == (40000, 50000)
    assert ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
    path.write_text("garbage\n")
    assert ephemeral_ports(str(path)) == (32768, 60999)


def test_with_no_room_below_the_range_the_kernel_chooses(monkeypatch):
    low, high = ephemeral_ports()  # where the kernel's own choice falls
    monkeypatch.setattr(supervision, "ephemeral_ports", lambda: (10500, 60999))
    assert low <= free_port() <= high
