"""sluice.keras's DistributedOptimizer options on 2 workers: backward passes, local layers, errors, overlap."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork  # noqa: F401 - imports the forked roles would make
from tests.integration.keras_aggregation_jobs import keras_optimizer_options

# the `tensorflow` extra; TF is imported by the workers only, so that no TF runtime state is ever forked
pytestmark = pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs the tensorflow extra")


def _close(got: Any, want: Any, rtol: float = 1e-5) -> None:
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=rtol, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_backward_passes_local_layers_errors_and_overlap_on_two_workers() -> None:
    # small fusion buffers: the MLP's gradients travel in several groups, so a send can leave early
    config = {"collective": {"fusion_bytes": 256, "stall_timeout": 10.0}}
    with LocalCluster(2, 0, config) as cluster:
        results = cluster.run(keras_optimizer_options, timeout=110)
        assert cluster.wait() == [0, 0, 0]
    for rank, out in enumerate(results):
        aggregation = out["aggregation"]
        # 6 passes, 3 per step: summed (fit, traced) or averaged (custom loop, eager) over the passes, then
        # averaged over the workers: one process on the whole batches; iterations count every pass
        _close(aggregation["fit"], aggregation["fit_reference"])
        _close(aggregation["loop"], aggregation["loop_reference"])
        assert aggregation["fit_iterations"] == aggregation["loop_iterations"] == 6
        assert aggregation["loop_unchanged"]
        # an infinite gradient spoils its own update; the next two passes start from zero sums
        spoiled, clean, iterations = aggregation["non_finite"]
        assert spoiled == [-np.inf, -2.0] and clean == [-4.5, -8.0] and iterations == 4
        # local layers: this worker's gradient / 2; the others: the whole batch's (eager; fit with 2 passes)
        for case in ("eager", "fit"):
            got, want = out["partial"][case]
            _close(got, want, rtol=2e-5)
        errors = out["errors"]
        for case in ("passes_zero", "op_min", "local_layers", "sparse_passes"):
            assert errors[case] == "InvalidCallError(ValueError)", (rank, case, errors[case])
        assert errors["wrapped_twice"] == "SluiceError"
        assert errors["disagree"] == "UnknownError"  # a py_function's code inside a tf.function
        assert errors["after_sparse"] == errors["after_disagree"] == [3.0]
        assert errors["agree_after"] == [-1.5] * 3
        assert out["overlap"] == {"sends": 4, "waits": 1, "first_needs_last_layer": True,
                                  "first_needs_first_layer": False}
    assert results[0]["aggregation"]["fit"] == results[1]["aggregation"]["fit"]  # bit for bit
    assert results[0]["aggregation"]["loop"] == results[1]["aggregation"]["loop"]
    assert results[0]["partial"]["eager"][0][2:] == results[1]["partial"]["eager"][0][2:]
    assert results[0]["partial"]["eager"][0][:2] != results[1]["partial"]["eager"][0][:2]  # local: their own
