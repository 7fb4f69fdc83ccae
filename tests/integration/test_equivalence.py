"""N workers through the parameter servers train exactly like one process on the global batches."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cluster import LocalCluster
from tests.integration.training import train_distributed, train_single

STEPS, BATCH = 20, 32


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("optimizer_on", "optimizer", "workers", "servers"),
    [("worker", "sgd", 4, 2), ("server", "sgd", 4, 2), ("server", "adam", 2, 3)],
)
def test_distributed_matches_single_process(optimizer_on: str, optimizer: str, workers: int, servers: int) -> None:
    reference = train_single(STEPS, BATCH, optimizer)
    with LocalCluster(workers, servers, {"worker": {"optimizer_on": optimizer_on}}) as cluster:
        results = cluster.run(train_distributed, STEPS, BATCH, optimizer)
        assert cluster.wait() == [0] * (1 + servers + workers)
    for other in results[1:]:
        assert other["digests"] == results[0]["digests"], "workers diverged after some step"
    assert len(results[0]["digests"]) == STEPS
    for got, want in zip(results[0]["params"], reference, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
