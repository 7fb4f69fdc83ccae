"""set_congestion_control only touches the socket an event named; refusal_advice says what to do."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.transport.tcp_tuning import refusal_advice, set_congestion_control

pytestmark = pytest.mark.skipif(not Path("/proc/sys/net/ipv4/tcp_congestion_control").exists(), reason="Linux")


def algorithm(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """A listener and a connection dialled to it on 127.0.0.1, and the listener's port."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    dialled = socket.create_connection(("127.0.0.1", port))
    yield listener, dialled, port
    dialled.close()
    listener.close()


def test_the_named_listener_and_connection_are_set(connection: tuple[socket.socket, socket.socket, int]) -> None:
    listener, dialled, port = connection
    assert set_congestion_control(listener.fileno(), f"tcp://127.0.0.1:{port}", True, "reno")
    assert set_congestion_control(dialled.fileno(), f"tcp://127.0.0.1:{port}", False, "reno")
    assert algorithm(listener) == algorithm(dialled) == "reno"


def test_an_ipv6_listener_and_connection_are_set() -> None:
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = listener.getsockname()[1]
    with listener, socket.create_connection(("::1", port)) as dialled:
        assert set_congestion_control(listener.fileno(), f"tcp://[::1]:{port}", True, "reno")
        assert set_congestion_control(dialled.fileno(), f"tcp://[::1]:{port}", False, "reno")
        assert algorithm(listener) == algorithm(dialled) == "reno"


@pytest.mark.parametrize(("endpoint", "listener"), [
    ("tcp://127.0.0.1:{other}", False),  # a descriptor now another connection's
    ("tcp://127.0.0.1:{other}", True),
    ("ipc://@sluice-x", False),  # a Unix socket: no congestion to control
    ("tcp://127.0.0.1:{port}", True),  # the dialled connection is no listener on that port
])
def test_a_descriptor_that_is_not_the_named_socket_is_left_alone(
        connection: tuple[socket.socket, socket.socket, int], endpoint: str, listener: bool) -> None:
    _, dialled, port = connection
    before = algorithm(dialled)
    assert not set_congestion_control(dialled.fileno(), endpoint.format(port=port, other=port + 1), listener, "reno")
    assert algorithm(dialled) == before


def test_a_closed_or_non_tcp_descriptor_is_left_alone() -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    port = udp.getsockname()[1]
    assert not set_congestion_control(udp.fileno(), f"tcp://127.0.0.1:{port}", True, "reno")
    udp.close()
    assert not set_congestion_control(udp.fileno(), f"tcp://127.0.0.1:{port}", True, "reno")  # -1 once closed
    assert not set_congestion_control(1 << 20, f"tcp://127.0.0.1:{port}", True, "reno")  # never opened


@pytest.mark.parametrize(("code", "says"), [
    (errno.EPERM, "sysctl -w net.ipv4.tcp_allowed_congestion_control="),
    (errno.ENOENT, "modprobe tcp_hybla"),
    (errno.EINVAL, "leave transport.congestion_control empty"),
])
def test_a_refusal_says_what_to_do(code: int, says: str) -> None:
    assert says in refusal_advice("hybla", OSError(code, "refused"))
