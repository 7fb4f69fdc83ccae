"""transport.congestion_control: two real ZmqTransports over TCP, and the algorithm the kernel reports on each end."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.transport.auth import JobKeys
from sluice.transport.config import TransportConfig
from sluice.transport.zmq_transport import ZmqTransport
from tests.integration.transport_helpers import CLIENT, SERVER, Inbox, warm_up

KEYS = JobKeys(b"a test secret of 32 bytes, fixed", [SERVER, CLIENT])
DEFAULT = Path("/proc/sys/net/ipv4/tcp_congestion_control")
pytestmark = pytest.mark.skipif(not DEFAULT.exists(), reason="Linux's TCP congestion controls")


def congestion_by_port(ports: set[int]) -> dict[tuple[str, int], str]:
    """The algorithm of each of this process's TCP connections to or from `ports`, as the kernel reports it:
    keyed ("dialled", the peer's port) or ("accepted", our port)."""
    found: dict[tuple[str, int], str] = {}
    for entry in Path("/proc/self/fd").iterdir():
        try:
            conn = socket.socket(fileno=os.dup(int(entry.name)))
        except OSError:
            continue
        with conn:
            try:
                if conn.type != socket.SOCK_STREAM or conn.family != socket.AF_INET:
                    continue
                local, peer = conn.getsockname()[1], conn.getpeername()[1]
                name = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
            except OSError:  # not a connection (a listener, a socket not connected)
                continue
        if peer in ports:
            found["dialled", peer] = name
        elif local in ports:
            found["accepted", local] = name
    return found


def pair(congestion_control: str, curve: bool) -> Iterator[tuple[ZmqTransport, ZmqTransport, set[int]]]:
    """A server and a client that dialled its TCP ports (not its Unix sockets), each channel warmed up."""
    config = TransportConfig(shm=False, curve=curve)
    # set past the check: "nosuch" plays a host whose kernel lacks what the job's config (checked elsewhere) names
    object.__setattr__(config, "congestion_control", congestion_control)
    inbox, back = Inbox(), Inbox()
    server = ZmqTransport(SERVER, config, inbox, KEYS if curve else None)
    client = ZmqTransport(CLIENT, config, back, KEYS if curve else None)
    try:
        network = [e for e in server.listen() if e.startswith("tcp://")]
        client.connect(SERVER, network)
        warm_up(client, SERVER, inbox, config.channels)
        warm_up(server, CLIENT, back, config.channels)
        yield server, client, {int(e.rsplit(":", 1)[1]) for e in network}
    finally:
        client.close(flush_seconds=0.2)
        server.close(flush_seconds=0.2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("curve", [True, False], ids=["sealed", "open"])
def test_every_connection_both_ends_run_the_configured_congestion_control(curve: bool) -> None:
    for server, client, ports in pair("reno", curve):  # reno: in every kernel, allowed to every process
        found = congestion_by_port(ports)
        assert sorted(found) == sorted([*(("dialled", p) for p in ports), *(("accepted", p) for p in ports)])
        assert set(found.values()) == {"reno"}, found
        assert server.stats()["tuned_connections"] == client.stats()["tuned_connections"] == len(ports)


@pytest.mark.timeout(30)
def test_without_the_setting_connections_keep_the_hosts_default() -> None:
    default = DEFAULT.read_text().strip()
    for server, client, ports in pair("", curve=True):
        found = congestion_by_port(ports)
        assert len(found) == 2 * len(ports) and set(found.values()) == {default}, found
        assert server.stats()["tuned_connections"] == client.stats()["tuned_connections"] == 0


@pytest.mark.timeout(30)
def test_a_kernel_that_refuses_the_algorithm_is_said_once_and_the_connections_still_carry(
        caplog: pytest.LogCaptureFixture) -> None:
    default = DEFAULT.read_text().strip()
    with caplog.at_level(logging.WARNING, logger="sluice.transport"):
        for server, client, ports in pair("nosuch", curve=True):  # warm_up: every channel carried both ways
            assert set(congestion_by_port(ports).values()) == {default}
            assert server.stats()["tuned_connections"] == client.stats()["tuned_connections"] == 0
    said = [r.getMessage() for r in caplog.records if "congestion control" in r.getMessage()]
    assert len(said) == 2, said  # once per process, not once per connection
    assert all("modprobe tcp_nosuch" in text and "keep the host's default" in text for text in said)


def test_a_name_that_is_no_algorithm_or_not_in_this_kernel_is_refused_at_start() -> None:
    for name, says in [("Cubic", "lower case"), ("cubic; rm", "lower case"), ("x" * 16, "at most 15"),
                       ("nosuch", "modprobe tcp_nosuch")]:
        with pytest.raises(ValueError, match=says):
            TransportConfig(congestion_control=name)
    assert TransportConfig(congestion_control="reno").congestion_control == "reno"
