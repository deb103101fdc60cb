"""How the processes of a multi-host pipeline find and trust each other (`jaxcpp.pipe.cluster`), and how
the head names a stage that failed: the shared control key is required, addresses come from the flags,
reachability is checked from the advertised address, and a stage that dies in native code is reported
with its fatal log line. The end-to-end checks on two network namespaces are tests/pipeline/test_multi_host.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from jaxcpp.config import ConfigError, ParallelConfig
from jaxcpp.head.supervision import StageLink, forward_log, how_it_ended
from jaxcpp.pipe.cluster import Addresses, check_local, check_reachable, shared_control_key
from jaxcpp.runtime.stage_setup import neighbours
from jaxcpp.serving.cli import main

MULTI_HOST = ["serve", "--pipeline-parallel-size", "2", "--num-processes", "2",
              "--coordinator-address", "127.0.0.1:8476"]


@pytest.mark.parametrize(("value", "says"), [
    (None, "a multi-host pipeline needs a shared control key"),
    ("not hex", "JAXCPP_CONTROL_KEY must be hex digits"),
    ("00ff", "JAXCPP_CONTROL_KEY holds 2 bytes, at least 16 are needed"),
])
def test_no_usable_shared_key_is_refused_saying_how_to_give_one(monkeypatch, value, says):
    if value is None:
        monkeypatch.delenv("JAXCPP_CONTROL_KEY", raising=False)
    else:
        monkeypatch.setenv("JAXCPP_CONTROL_KEY", value)
    with pytest.raises(ConfigError, match=says) as err:
        shared_control_key()
    assert "export JAXCPP_CONTROL_KEY=$(openssl rand -hex 32)" in str(err.value)


def test_a_shared_key_is_read_as_hex(monkeypatch):
    monkeypatch.setenv("JAXCPP_CONTROL_KEY", "ab" * 32)
    assert shared_control_key() == b"\xab" * 32


@pytest.mark.parametrize("process_id", ["0", "1"])
def test_serve_without_a_shared_key_stops_in_one_line_before_starting(monkeypatch, capsys, process_id):
    monkeypatch.delenv("JAXCPP_CONTROL_KEY", raising=False)
    assert main([*MULTI_HOST, "--process-id", process_id]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxcpp serve: error: a multi-host pipeline needs a shared control key: set "
                          "JAXCPP_CONTROL_KEY") and "\n" not in err, err


def test_addresses_follow_the_flags():
    explicit = ParallelConfig(pipeline_parallel_size=2, num_processes=2, process_id=1,
                              coordinator_address="head.svc:8476", advertise_address="10.0.0.7")
    assert Addresses.of(explicit) == Addresses("head.svc:8476", "head.svc:8477", "10.0.0.7")
    local = ParallelConfig(pipeline_parallel_size=2, num_processes=2, process_id=0,
                           coordinator_address="127.0.0.1:9000")
    assert Addresses.of(local) == Addresses("127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1")  # its own route


@pytest.mark.parametrize(("kwargs", "says"), [
    (dict(num_processes=2, process_id=1, coordinator_address="h:1", advertise_address="pod-1.svc"),
     "--advertise-address: an IP address of this host is needed"),
    (dict(advertise_address="10.0.0.7"), "--advertise-address: applies to a pipeline over several hosts"),
])
def test_bad_advertise_address_names_the_flag(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        ParallelConfig(pipeline_parallel_size=2, **kwargs)


def test_an_address_of_another_host_cannot_be_advertised():
    with pytest.raises(ConnectionError, match=r"cannot bind the advertised address 192\.0\.2\.1: .*--advertise"):
        check_local("192.0.2.1")  # TEST-NET-1: nobody's address


def test_reachability_is_checked_from_the_advertised_address():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_reachable("127.0.0.1", f"127.0.0.1:{listening.getsockname()[1]}", "stage 1's transfer server")
        closed = listening.getsockname()[1]
    with pytest.raises(ConnectionError, match=rf"cannot reach stage 1's transfer server at 127\.0\.0\.1:{closed} "
                                              r"from 127\.0\.0\.1: Connection refused"):
        check_reachable("127.0.0.1", f"127.0.0.1:{closed}", "stage 1's transfer server")
    # a loopback source reaches no other host (jax's transport aborts the process on this)
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1 is a loopback address: .* give --advertise-address"):
        check_reachable("127.0.0.1", "192.0.2.1:9", "the jax.distributed coordinator")


@pytest.mark.parametrize(("index", "num_stages", "peers"), [
    (0, 1, []), (0, 2, [1]), (1, 2, [0]), (0, 4, [1, 3]), (1, 4, [0, 2]), (3, 4, [0, 2]),
])
def test_each_stage_checks_the_transfer_servers_it_exchanges_with(index, num_stages, peers):
    assert neighbours(index, num_stages) == peers


FATAL = ("F1202 06:06:55.368775 6112 socket_bulk_transport.cc:694] Check failed: connect(cfd, ...) == 0 "
         "(-1 vs. 0) Invalid argument 22")


def test_a_spawned_stage_that_aborts_in_native_code_is_reported_with_its_fatal_line():
    script = ("import os, sys; sys.stderr.write('I1202 loaded\\n' + sys.argv[1] + '\\n*** Check failure stack "
              "trace: ***\\n    @     0x7f0898b40634  absl::log_internal::LogMessage::SendToLog()\\n'); "
              "sys.stderr.flush(); os.abort()")
    ln = StageLink(0, pid=1234, host="host-a", address="10.0.0.1", transfer="10.0.0.1:4567")
    ln.process = subprocess.Popen([sys.executable, "-c", script, FATAL], stderr=subprocess.PIPE)
    ln.log_reader = threading.Thread(target=forward_log, args=(ln, ln.process.stderr))
    ln.log_reader.start()
    error = ln.error(f"stage process ended: {how_it_ended(ln, wait_s=60)}")
    assert str(error) == (f"stage 0 (pid 1234 on host-a at 10.0.0.1, transfer server 10.0.0.1:4567): stage "
                          f"process ended: process {ln.process.pid} was killed by SIGABRT; its log ends: {FATAL}")
    assert error.stage == 0 and error.fatal
