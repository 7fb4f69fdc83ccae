"""sluice.tensorflow's DistributedOptimizer, PartialDistributedGradientTape and SyncBatchNormalization, on 2 workers."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork  # noqa: F401 - imports the forked roles would make
from tests.integration.tf_optimizer_jobs import tf_optimizers

# the `tensorflow` extra (the Makefile installs it). Not imported here: each forked worker imports it itself
pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs the tensorflow extra")


def _close(got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6, what: str = "") -> None:
    assert len(got) == len(want), what
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_optimizer_partial_tape_and_sync_batch_norm_on_two_workers() -> None:
    with LocalCluster(2, 0, {"collective": {"stall_timeout": 10.0}}) as cluster:
        results = cluster.run(tf_optimizers, timeout=110)
        assert cluster.wait() == [0, 0, 0]
    for rank, out in enumerate(results):
        # TF1 momentum SGD in a tf.function (minimize), two workers on half batches = one process on the whole
        _close(out["legacy"], out["legacy_reference"])
        assert out["legacy_facts"] == [True, ["momentum"], 4]
        eager = out["legacy_eager"]
        # op=Sum: 1 + 2 for the shared variable; the local one's own 2(r + 1), halved or not
        assert eager["scale_True"] == [[3.0, 3.0], [rank + 1.0]]
        assert eager["scale_False"] == [[3.0, 3.0], [2.0 * (rank + 1)]]
        assert eager["applied"] == [[-2.0, -2.0], [-1.0 - 2.0 * rank]]
        # backward_passes_per_step=4 in a TF1 session: every 4th pass the mean of the ranks' gradients (0 and 1;
        # the sparse one's 1 and 2), each pass counted by the global step
        rounds = [(k + 1) // 4 for k in range(10)]
        assert out["aggregation"]["values"] == [[0.5 * r, 0.0, 1.5 * r] for r in rounds]
        assert out["aggregation"]["steps"] == list(range(10))
        assert out["keras"][0] and out["keras"][2] == [-1.5, -1.5]  # sluice.keras's wrapper: the mean of 1 and 2
        partial = out["partial"]
        paths = partial["layer_paths"]
        assert partial["split"] == [paths[:2], paths[2:]]
        _close(partial["partial_True"][2:], partial["whole"][2:])  # the shared layer: the whole batch's gradient
        _close(partial["partial_True"][:2], [np.array(g) / 2 for g in partial["own"][:2]])
        _close(partial["partial_False"][:2], partial["own"][:2])
        for case, values in out["sync_bn"].items():
            _close(values["got"], values["want"], rtol=1e-9, atol=1e-10, what=case)
        arguments = out["arguments"]
        assert arguments == {case: "ValueError" for case in arguments} and len(arguments) == 11, arguments
        disagreements = out["disagreements"]
        assert {case: raised for case, (raised, _) in disagreements.items()} == {
            "optimizer_shapes": "FailedPreconditionError", "optimizer_shapes_traced": "UnknownError",
            "sync_bn_channels": "FailedPreconditionError"}
        assert all(after == [3.0, 3.0] for _, after in disagreements.values())
    assert results[0]["legacy"] == results[1]["legacy"]  # bit for bit
