"""`sluice node` standby schedulers as Kubernetes runs them: a lost scheduler's pod is started again and stands by.

What a JobSet from `sluice kubernetes` does, played on 127.0.0.1: one process per pod, the scheduler's
pod killed and started again with its index's failure count (as the Job's backoffLimitPerIndex restarts
it), then the standby that took over killed and started again too. The nodes go round the ring of
schedulers; every round's sum is checked in the workers, who never stop stepping.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from sluice.launch.master_port import free_port
from sluice.launch.node import role_of
from tests.integration.node_procs import Node, env_without_sluice, secret_file, start_node

# Each worker pushes (rank + 1) * (step + 1) and checks the sum of both, every step, until told to stop. The
# stop is agreed in the sum itself (the last element counts the workers that saw the file, from step 20 on):
# a worker that saw it alone would leave the other's next round without its push.
WORKER = """
import os, sys, time
import numpy as np
from sluice.worker.node import WorkerNode
node = WorkerNode()
client = node.ps
client.declare([("w", (1001,), "float32", None)])
out = np.zeros(1001, np.float32)
step = 0
while True:
    push = np.full(1001, (client.rank + 1) * (step + 1), np.float32)
    push[-1] = step >= 20 and os.path.exists(sys.argv[1])
    client.push_pull("w", push, out).wait(30)
    if not (out[:-1] == 3 * (step + 1)).all():
        sys.exit(f"step {step}: sum {out[0]}, expected {3 * (step + 1)}")
    step += 1
    print("step", step, flush=True)
    if out[-1] > 0:
        break
    time.sleep(0.02)
print("sum", out[0], "after", step, "steps", flush=True)
node.close()
"""


def test_standby_schedulers_are_the_indexes_after_the_workers() -> None:
    assert [role_of(i, 2, 1, 0, standbys=2) for i in range(6)] == [
        ("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1), ("scheduler", 1), ("scheduler", 2)]


def _steps(node: Node) -> int:
    return sum(line.startswith("step ") for line in node.lines)


def _after(node: Node, steps: int, timeout: float) -> None:
    """Until `node` made `steps` more steps than now."""
    node.wait_for(f"step {_steps(node) + steps}", timeout)


@pytest.mark.timeout(120)
def test_failover_scheduler_pod_lost_then_its_standby_the_job_goes_round_the_ring_and_ends(
        nodes: list[Node], tmp_path: Path) -> None:
    secret, stop = secret_file(tmp_path / "secret"), tmp_path / "stop"
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    port, standby_port = free_port(), free_port()
    job = ["-w", "2", "-s", "1", "--scheduler", f"127.0.0.1:{port}", "--standby", f"127.0.0.1:{standby_port}",
           "--secret-file", str(secret), "--set", "scheduler.heartbeat_interval=0.2",
           "--set", "scheduler.heartbeat_timeout=1.5", "--", sys.executable, str(script), str(stop)]
    scheduler, server, worker0, worker1, standby = (start_node(nodes, index, job) for index in range(5))
    standby.wait_for("standby scheduler ready at", 30)
    _after(worker0, 10, 60)

    # the scheduler's pod is lost; Kubernetes starts it again, its index's failure count 1 in the environment
    scheduler.kill()
    again = start_node(nodes, 0, job, env_without_sluice(SLUICE_INDEX_FAILURES="1"))
    standby.wait_for("took over from the silent scheduler", 30)
    again.wait_for(f"this pod stands by at 127.0.0.1:{port} in turn", 30)
    again.wait_for("standby scheduler ready at", 30)
    _after(worker1, 10, 30)

    # now the standby that took over is lost, and started again by its own Job (the option, this time)
    standby.kill()
    standby_again = start_node(nodes, 4, ["--index-failures", "1", *job])
    again.wait_for("took over from the silent scheduler", 30)
    standby_again.wait_for("standby scheduler ready at", 30)
    _after(worker0, 10, 30)

    stop.touch()
    codes = [node.finish(60) for node in (worker0, worker1, server, again)]
    assert codes == [0, 0, 0, 0], "\n\n".join(n.output()[-3000:] for n in (worker0, worker1, server, again))
    for worker in (worker0, worker1):
        out = worker.output()
        # round the ring: the standby first, then the scheduler's address, where its pod stands by again
        assert f"rejoining the standby scheduler at tcp://127.0.0.1:{standby_port}" in out, out[-3000:]
        assert f"rejoining the standby scheduler at tcp://127.0.0.1:{port}" in out, out[-3000:]
        assert "sum" in out and _steps(worker) >= 50
    # the standby that never took over waits for as long as it runs: the JobSet's end deletes its pod
    assert standby_again.proc.poll() is None, standby_again.output()
    standby_again.proc.send_signal(signal.SIGTERM)
    standby_again.finish(15)
