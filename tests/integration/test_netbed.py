"""The shaped-network testbed: hosts reach each other, a shaped link holds its rate, nothing is left."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.netbed import PREFIX, Netbed, _namespaces
from tests.bench_runs import requires_testbed

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
