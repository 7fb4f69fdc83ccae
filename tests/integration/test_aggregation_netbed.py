"""On the testbed: another job's traffic on an auxiliary host moves weight off it, through the agents."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from testbed.bench_runs import requires_testbed
from testbed.job import run_sluice_job
from testbed.netbed import Netbed

pytestmark = requires_testbed
ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import time
import numpy as np
from testbed.job import emit_result
from sluice.worker.node import WorkerNode
node = WorkerNode()
client = node.ps
client.declare([("grad", (65536,), "float32", None), ("vote", (1,), "int32", None)])
data, out, votes = np.ones(65536, np.float32), np.empty(65536, np.float32), np.zeros(1, np.int32)
grad = client._tensors["grad"]
epochs, first, deadline = [], [], time.monotonic() + 60
while votes[0] < client.size:  # until every worker has switched twice (or the deadline passed on all)
    before = client._router.routed
    client.push_pull("grad", data, out).wait()
    assert out[0] == client.size, out[0]
    # the trees this round took (a round started before a COMMIT came took the older ones, straight to the
    # servers before the first); counted from the pushes it sent up a tree
    epochs.append(client._router.epoch_of(grad.key, grad.round))
    if epochs[-1] == 1:
        first.append(client._router.routed - before)
    vote = client._router.epoch >= 2 or time.monotonic() > deadline
    client.push_pull("vote", np.array([vote], np.int32), votes).wait()
last = client._router.routed
for _ in range(5):  # the new trees in force on every worker
    client.push_pull("grad", data, out).wait()
emit_result({"epochs": epochs, "epoch": client._router.epoch, "up_a_round_first": sum(first) / max(len(first), 1),
             "up_a_round_last": (client._router.routed - last) / 5})
node.close()
"""
#: another job: as much traffic as the auxiliary host's link carries, to the scheduler's host
SENDER = """
import socket, sys, time
time.sleep(float(sys.argv[3]))
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as conn:
    while True:
        conn.sendall(b"x" * 65536)
"""
SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while conn.recv(1 << 16):
    pass
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_another_jobs_traffic_on_the_auxiliary_host_moves_weight_off_it() -> None:
    import subprocess

    with Netbed(queue_ms=1000) as bed:
        bed.rack("r0", uplink_mbit=10)
        for host in ("w0", "w1", "ax"):
            bed.host(host, 20, rack="r0")
        bed.rack("srv")
        bed.host("s0", 80, rack="srv")
        bed.host("sched")
        address = {name: host.address for name, host in bed.hosts.items()}
        sink = bed.run("sched", [sys.executable, "-c", SINK, address["sched"]], stdout=subprocess.PIPE, text=True)
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        bed.run("ax", [sys.executable, "-c", SENDER, address["sched"], port, "6"])  # starts 6 s from now
        config = {"transport": {"chunk_bytes": 16384, "inflight_bytes": 16384}, "aggregation": {
            "mode": "plan", "racks": [f"r0: {address['w0']} {address['w1']} {address['ax']}",
                                      f"srv: {address['s0']}"],
            "link_mbit": 20.0, "uplink_mbit": 10.0, "links": [f"{address['s0']}: 80"],
            "uplinks": ["srv: 1000"]}}
        results = run_sluice_job(bed, "sched", ["s0"], ["w0", "w1"], config, [sys.executable, "-c", WORKER],
                                 aggregators=["ax"], timeout=120)
    for result in results:
        assert result["epoch"] >= 2, result["epochs"]  # planned again once the agents saw the traffic
        assert result["up_a_round_first"] > 0, result  # the first plan sent pushes through the auxiliary host
        assert result["up_a_round_last"] < result["up_a_round_first"], result  # the new one sends it fewer
