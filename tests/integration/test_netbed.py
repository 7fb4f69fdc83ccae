"""The shaped-network testbed: hosts reach each other, a shaped link holds its rate, nothing is left."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testbed.bench_runs import requires_testbed
from testbed.netbed import PREFIX, Netbed, _namespaces, root_congestion_control

pytestmark = requires_testbed

RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
total, started = 0, None
while chunk := conn.recv(1 << 16):
    started = started or time.perf_counter()
    total += len(chunk)
print(total * 8 / (time.perf_counter() - started) / 1e6, flush=True)
"""

SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as conn:
    conn.sendall(b"x" * int(sys.argv[3]))
"""


def _mbit(bed: Netbed, sender: str, receiver: str, nbytes: int) -> float:
    listener = bed.run(receiver, [sys.executable, "-c", RECEIVER, bed.hosts[receiver].address],
                       stdout=subprocess.PIPE, text=True)
    assert listener.stdout is not None
    port = listener.stdout.readline().strip()
    bed.run(sender, [sys.executable, "-c", SENDER, bed.hosts[receiver].address, port, str(nbytes)]).wait(30)
    return float(listener.stdout.readline())


@pytest.mark.timeout(60)
def test_shaped_link_holds_its_rate_and_everything_is_removed() -> None:
    with Netbed() as bed:
        bed.host("a", rate_mbit=100)
        bed.host("b", rate_mbit=100, tos_bands=True)
        bed.host("c")
        rate = _mbit(bed, "a", "b", 3_000_000)  # about 0.25 s at 100 Mbit/s
        assert 70 < rate < 110, rate
        assert _mbit(bed, "c", "c", 3_000_000) > 300  # within an unshaped host: far faster
        assert "pfifo_fast" in bed.tc_stats("b") and "tbf" in bed.tc_stats("b")
        tag = bed.tag
        assert {f"{tag}-a", f"{tag}-b", f"{tag}-c", f"{tag}-sw"} <= set(_namespaces())
    assert not [n for n in _namespaces() if n.startswith(f"{tag}-")]


@pytest.mark.timeout(30)
def test_a_failure_inside_the_testbed_still_removes_it() -> None:
    with pytest.raises(ValueError, match="host name"), Netbed() as bed:
        bed.host("a", rate_mbit=10)
        tag = bed.tag
        bed.host("Not Valid")
    assert not [n for n in _namespaces() if n.startswith(f"{tag}-") and n.startswith(PREFIX)]


# ---------------------------------------------------------------------------- racks
def _two_racks(bed: Netbed, uplink_mbit: float, tos_classes: tuple[int, ...] = ()) -> None:
    """Racks r1 (hosts a, b) and r2 (hosts c, d), hosts on 50 Mbit/s links."""
    for rack, hosts in (("r1", "ab"), ("r2", "cd")):
        bed.rack(rack, uplink_mbit=uplink_mbit, tos_classes=tos_classes)
        for host in hosts:
            bed.host(host, rate_mbit=50, rack=rack)


@pytest.mark.timeout(30)
def test_a_rack_uplink_limits_only_traffic_between_racks() -> None:
    with Netbed() as bed:
        _two_racks(bed, uplink_mbit=20)
        assert bed.hosts["a"].rack == "r1" and bed.racks["r2"].uplink_mbit == 20
        sw = f"{bed.tag}-sw"
        ports = subprocess.run(["ip", "-n", sw, "-o", "link", "show", "master", "br-r1"], capture_output=True,
                               text=True, check=True).stdout
        assert bed.hosts["a"].port in ports and bed.racks["r1"].uplink_port_up in ports
        inside = _mbit(bed, "a", "b", 2_500_000)  # about 0.4 s at 50 Mbit/s
        assert 35 < inside < 60, inside
        across = _mbit(bed, "a", "c", 1_000_000)  # about 0.4 s at 20 Mbit/s
        assert 14 < across < 24, across
        assert "tbf" in bed.uplink_tc_stats("r1", "up") and "tbf" in bed.uplink_tc_stats("r2", "down")
        tag = bed.tag
    assert not [n for n in _namespaces() if n.startswith(f"{tag}-")]


@pytest.mark.timeout(30)
def test_set_uplink_and_set_rate_rerate_a_link_at_run_time() -> None:
    with Netbed() as bed:
        _two_racks(bed, uplink_mbit=20)
        bed.set_uplink("r1", 5)
        assert bed.racks["r1"].uplink_mbit == 5
        across = _mbit(bed, "c", "a", 250_000)  # about 0.4 s at 5 Mbit/s (into r1: its uplink's down direction)
        assert 3.5 < across < 6.5, across
        bed.set_rate("b", 5)
        inside = _mbit(bed, "a", "b", 250_000)
        assert 3.5 < inside < 6.5, inside
        bed.rack("r3")
        bed.host("e", rack="r3")
        with pytest.raises(ValueError, match="not shaped"):
            bed.set_uplink("r3", 5)
        with pytest.raises(ValueError, match="not shaped"):
            bed.set_rate("e", 5)


@pytest.mark.timeout(30)
def test_uplink_tos_classes_count_the_traffic_of_their_tos_and_survive_a_rerate() -> None:
    with Netbed() as bed:
        _two_racks(bed, uplink_mbit=20, tos_classes=(0xB8, 0x00))
        before = bed.uplink_class_bytes("r1", "up")
        assert set(before) == {0xB8, 0x00, None}
        nbytes = 1_000_000
        assert 14 < _mbit(bed, "a", "c", nbytes) < 24
        after = bed.uplink_class_bytes("r1", "up")
        # the sockets leave ToS 0x00: its class carries the data (plus TCP/IP headers), 0xb8's nothing
        assert nbytes <= after[0x00] - before[0x00] <= nbytes * 1.08, after
        assert after[0xB8] == before[0xB8]
        assert bed.uplink_class_bytes("r2", "down")[0x00] >= nbytes
        bed.set_uplink("r1", 5)  # htb classes stay under the tbf and share the new rate
        assert 3.5 < _mbit(bed, "a", "c", 250_000) < 6.5
        assert bed.uplink_class_bytes("r1", "up")[0x00] >= after[0x00] + 250_000
        with pytest.raises(ValueError, match="direction"):
            bed.uplink_class_bytes("r1", "out")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_host_in_an_unknown_rack_is_refused_and_the_testbed_removed() -> None:
    with pytest.raises(ValueError, match="no rack 'r9'"), Netbed() as bed:
        tag = bed.tag
        bed.rack("r1", uplink_mbit=10)
        with pytest.raises(ValueError, match="rack name"):
            bed.rack("r1")
        with pytest.raises(ValueError, match="uplink_mbit"):
            bed.rack("r2", tos_bands=True)
        bed.host("a", rate_mbit=10, rack="r1")
        bed.host("b", rack="r9")
    assert not [n for n in _namespaces() if n.startswith(f"{tag}-")]


@pytest.mark.timeout(30)
def test_congestion_control_is_set_in_every_host_or_refused_saying_how_to_allow_it() -> None:
    def in_force(bed: Netbed, host: str) -> str:
        return bed.run(host, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], stdout=subprocess.PIPE,
                       text=True).communicate(timeout=10)[0].strip()

    with Netbed() as bed:
        bed.host("a")
        bed.host("b")
        assert bed.congestion_control() == root_congestion_control() == in_force(bed, "a")
        assert bed.congestion_control("reno") == "reno"  # any namespace may choose reno
        assert in_force(bed, "a") == in_force(bed, "b") == "reno"
        with pytest.raises(ValueError, match="tcp_allowed_congestion_control"):
            bed.congestion_control("no-such-control")
