"""The numpy client end to end: registered and plain arrays, push and pull apart, broadcast."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cluster import LocalCluster


def _sum_both_ways(n: int) -> list[float]:
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("r", (n,), "float32", None), ("p", (n,), "float32", None)])
    registered = client.alloc((n,), "float32")
    plain = np.empty(n, np.float32)
    out_r, out_p = np.empty(n, np.float32), np.empty(n, np.float32)
    sums = []
    for step in range(3):
        registered[:] = np.arange(n, dtype=np.float32) * (client.rank + 1) + step
        plain[:] = registered
        handles = [client.push_pull("r", registered, out_r), client.push_pull("p", plain, out_p)]
        for handle in handles:
            handle.wait()
        np.testing.assert_array_equal(out_r, out_p)
        sums.append(float(out_r[-1]))
    node.close()
    return sums


@pytest.mark.timeout(60)
def test_registered_and_plain_arrays_sum_alike() -> None:
    n = 1 << 20  # 4 MiB: several chunks, all above the shared-memory threshold
    with LocalCluster(2, 2) as cluster:
        results = cluster.run(_sum_both_ways, n)
    expected = [float((n - 1) * 3 + 2 * step) for step in range(3)]
    assert results == [expected, expected]


def _push_then_pull(n: int) -> list[float]:
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("g", (n,), "float32", None), ("b", (n,), "float64", None)])
    out = np.empty(n, np.float32)
    seen = []
    for step in range(3):
        pushed = client.push("g", np.full(n, client.rank + step, np.float32))
        pushed.wait()
        assert pushed.done()
        client.pull("g", out).wait()  # waits until every worker's push of this round is summed
        seen.append(float(out[0]))
    shared = np.full(n, 7.0 if client.rank == 1 else -1.0)
    client.broadcast("b", shared, root=1).wait()
    seen.append(float(shared[-1]))
    node.close()
    return seen


@pytest.mark.timeout(60)
def test_push_and_pull_separately_and_broadcast() -> None:
    with LocalCluster(3, 2) as cluster:
        results = cluster.run(_push_then_pull, 5000)
    # round r sums ranks 0..2 plus 3 * r
    assert results == [[3.0, 6.0, 9.0, 7.0]] * 3
