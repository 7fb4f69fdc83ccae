"""Pushing from registered memory (Client.alloc) gives the same sums as from ordinary arrays."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cluster import LocalCluster


def _sum_both_ways(n: int) -> list[float]:
    from worker.client import Client

    client = Client()
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
    client.close()
    return sums


@pytest.mark.timeout(60)
def test_registered_and_plain_arrays_sum_alike() -> None:
    n = 1 << 20  # 4 MiB: several chunks, all above the shared-memory threshold
    with LocalCluster(2, 2) as cluster:
        results = cluster.run(_sum_both_ways, n)
    expected = [float((n - 1) * 3 + 2 * step) for step in range(3)]
    assert results == [expected, expected]
