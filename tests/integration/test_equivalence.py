"""N workers through the parameter servers train exactly like one process on the global batches."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration.training import record_pushes, train_distributed, train_scheduled, train_single

STEPS, BATCH = 20, 32


#: small fusion buffers, so that the demo model's gradients fill several groups
FUSED = {"fusion_bytes": 256}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("optimizer_on", "overlap", "optimizer", "workers", "servers", "collective"),
    [
        ("worker", True, "sgd", 4, 2, {"mode": "ps"}),
        ("worker", False, "sgd", 2, 1, {"mode": "ps", "fusion_bytes": 0}),
        ("worker", True, "adam", 2, 1, {"mode": "ps", **FUSED}),
        ("worker", True, "sgd", 4, 0, FUSED),  # pure allreduce
        ("worker", True, "sgd", 2, 0, {"fusion": "greedy", "fusion_bytes": 1024}),  # Horovod's fusion (baseline)
        ("worker", False, "adam", 4, 0, {"fusion_bytes": 0, "algorithm": "tree"}),
        ("worker", True, "sgd", 4, 2, {"mode": "auto", **FUSED}),  # auto: all on one host, so allreduce
        ("worker", True, "sgd", 4, 1, {"mode": "ps", "allreduce_patterns": ["*.bias"], **FUSED}),  # hybrid
        # the device-resident path (what CUDA gradients take) on the CPU, each group whole (one host): local_group
        ("worker", True, "adam", 2, 1, {"mode": "ps", "allreduce_patterns": ["*.bias"], "local_group": "torch",
                                        **FUSED}),
        ("server", True, "sgd", 4, 2, {}),
        ("server", True, "adam", 2, 3, {}),
    ],
)
def test_distributed_matches_single_process(
    optimizer_on: str, overlap: bool, optimizer: str, workers: int, servers: int, collective: dict[str, object]
) -> None:
    reference = train_single(STEPS, BATCH, optimizer)
    config = {"worker": {"optimizer_on": optimizer_on, "overlap_step": overlap}, "collective": collective}
    with LocalCluster(workers, servers, config) as cluster:
        results = cluster.run(train_distributed, STEPS, BATCH, optimizer)
        assert cluster.wait() == [0] * (1 + servers + workers)
    for other in results[1:]:
        assert other["digests"] == results[0]["digests"], "workers diverged after some step"
    assert len(results[0]["digests"]) == STEPS
    for got, want in zip(results[0]["params"], reference, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    # step() returned before the updates (optimizer on the servers, or overlapped on the workers):
    # each forward pass waited for them, layer by layer; else step() had waited for all of them
    assert results[0]["waits_in_forward"] == (4 * (STEPS - 1) if overlap else 0)
    if optimizer_on == "worker" and overlap and "fusion_bytes" not in collective:
        # one fused group: the first layer's wait finds every update in, and one inner step() applies them all
        # (each step() counted twice: DistributedOptimizer's, which defers, and the wrapped optimizer's)
        assert results[0]["optimizer_steps"] == 2 * STEPS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer_on", ["worker", "server"])
def test_non_contiguous_parameters_go_through_staging_buffers(optimizer_on: str) -> None:
    """The host staging path (what CUDA tensors take) exercised on the CPU with a strided weight."""
    with LocalCluster(2, 1, {"worker": {"optimizer_on": optimizer_on}}) as cluster:
        results = cluster.run(train_distributed, STEPS, BATCH, "sgd", None, True)
    reference = train_single(STEPS, BATCH, "sgd", strided=True)
    assert results[0]["digests"] == results[1]["digests"]
    for got, want in zip(results[0]["params"], reference, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_asynchronous_mode_with_one_worker_matches_single_process() -> None:
    reference = train_single(STEPS, BATCH, "sgd")
    config = {"worker": {"optimizer_on": "server"}, "ps": {"sync": False}}
    with LocalCluster(1, 2, config) as cluster:
        (result,) = cluster.run(train_distributed, STEPS, BATCH, "sgd")
    for got, want in zip(result["params"], reference, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_asynchronous_mode_trains_with_several_workers() -> None:
    config = {"worker": {"optimizer_on": "server"}, "ps": {"sync": False}}
    with LocalCluster(3, 1, config) as cluster:
        results = cluster.run(train_distributed, STEPS, BATCH // 2, "sgd")
    for result in results:
        assert all(np.isfinite(p).all() for p in result["params"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [1, 0])
def test_gradients_are_sent_from_autograd_hooks_during_backward(servers: int) -> None:
    """Unfused, each gradient leaves alone (the last layer's first); fused in small groups, each group
    leaves as its last gradient arrives, all during backward."""
    config = {"collective": {"fusion_bytes": 0, "mode": "ps"}}
    with LocalCluster(2, servers, config) as cluster:
        pushes = cluster.run(record_pushes, 3)[0]
    assert all(during for _, during in pushes), "a gradient was sent after backward() returned"
    route = "ps" if servers else "allreduce"
    assert [name for name, _ in pushes[:4]] == [f"fusion.{route}.float32.{i}" for i in range(4)]


@pytest.mark.timeout(120)
def test_two_runs_give_bitwise_identical_parameters() -> None:
    """Fusion on, three workers (so the order of a sum matters), hybrid: the same seeds, the same bits."""
    config = {"collective": {"mode": "ps", "allreduce_patterns": ["*.bias"], **FUSED}}
    runs = []
    for _ in range(2):
        with LocalCluster(3, 2, config) as cluster:
            runs.append(cluster.run(train_distributed, STEPS, 30, "sgd"))
    assert runs[0][0]["digests"] == runs[1][0]["digests"]
    assert runs[0][0]["digests"] == runs[0][2]["digests"]


@pytest.mark.timeout(120)
def test_overlapped_steps_keep_the_lr_schedule_and_horovods_clipping_idiom() -> None:
    reference = train_scheduled(STEPS, BATCH, distributed=False)
    with LocalCluster(2, 1) as cluster:
        results = cluster.run(train_scheduled, STEPS, BATCH, True)
    for got, want in zip(results[0], reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
