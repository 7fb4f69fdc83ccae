"""DistributedOptimizer's lifecycle as Horovod's, in jobs of 2 and 3 workers: optimizers one after another and
two at once with requires_grad switched, Horovod's default names, its errors for bad named_parameters, and
a gradient one rank never computes; the parameters match one process training on the whole batch."""

from __future__ import annotations

import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork
from tests.integration.optimizer_lifecycle_jobs import adasum_reference, adasum_training, lifecycle, reference

prefork.torch_optimizers()  # once here, not in every forked worker

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("workers", "servers", "optimizer_on"), [(2, 0, "worker"), (3, 0, "worker"),
                                                                    (2, 1, "server")])
def test_optimizer_lifecycle_matches_one_process(workers: int, servers: int, optimizer_on: str) -> None:
    with LocalCluster(workers, servers, {"worker": {"optimizer_on": optimizer_on}}) as cluster:
        results = cluster.run(lifecycle, timeout=150)
    want = reference(workers)
    for rank, out in enumerate(results):
        for case in ("gan", "force"):
            assert out[case] == pytest.approx(want[case], rel=1e-4, abs=1e-5), (rank, case)
        for got, expected in zip(out["sequential"], want["sequential"], strict=True):
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-5), (rank, "sequential")
        assert out["default_names"] == ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
                                        "allreduce.noname.1.1"]
        assert [text[:10] for text in out["bad_named"]] == ["ValueError"] * 3, out["bad_named"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3])
def test_adasum_optimizer_combines_the_workers_steps_as_horovods(workers: int) -> None:
    with LocalCluster(workers, 0) as cluster:
        results = cluster.run(adasum_training, timeout=100)
    want = adasum_reference(workers)
    for out in results:
        assert out[:-1] == pytest.approx(want, rel=1e-4, abs=1e-6)
        assert out[-1] == "Skipping synchronization is not supported when using Adasum optimizer."
