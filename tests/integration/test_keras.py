"""sluice.keras: Horovod's Keras API for Keras 3 on real workers (model.fit, custom loops, callbacks, the example)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import (
    prefork,  # noqa: F401 - imports the forked roles would make
    preloads,
)
from tests.integration.keras_jobs import keras_api

# the `tensorflow` extra (the Makefile installs it). Not imported here: each forked worker imports it itself,
# so that no TF runtime state is ever forked
pytestmark = pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs the tensorflow extra")

ROOT = Path(__file__).resolve().parents[2]


def _close(got: list[list[float]], want: list[list[float]]) -> None:
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fit_custom_loop_and_callbacks_on_two_workers(tmp_path: Path) -> None:
    with LocalCluster(2, 0, {"collective": {"fusion_bytes": 256}}) as cluster:
        results = cluster.run(keras_api, str(tmp_path), timeout=110)
        assert cluster.wait() == [0, 0, 0]
    for out in results:
        # two workers on half batches match one process on the whole batches, through fit and a custom loop
        _close(out["fit"], out["fit_reference"])
        np.testing.assert_allclose(out["fit_loss"], out["fit_reference_loss"], rtol=1e-5)  # averaged over ranks
        _close(out["loop"], out["loop_reference"])
        assert out["isinstance"]
        assert out["serialized"] == ["SGD", 0.5] and out["deserialized"] == "SGD"  # saved as the plain optimizer
        assert out["loaded"] == [True, 6, True]  # wrapped again, with the saved state
        assert out["metric_average"] == {"loss": 0.5, "accuracy": 1.0, "note": "text"}
        lr = LR_WARMUP
        np.testing.assert_allclose(out["warmup"], lr, rtol=1e-6)
        np.testing.assert_allclose(out["warmup_logged"], [lr[2], lr[5], lr[8]], rtol=1e-6)
        assert "jit_compile=False" in out["xla_error"], out["xla_error"][-2000:]
        assert out["xla_off"][0] is False
    assert results[0]["fit"] == results[1]["fit"]  # the broadcast aligned different starting points
    assert results[0]["xla_off"] == results[1]["xla_off"]


#: lr = 0.1 / 2 * (x / 2 + 1) before batch b of epoch e, x = e + (b + 1) / 3 (Horovod's warm-up, 2 workers,
#: 2 warm-up epochs of 3 batches), then 0.1
LR_WARMUP = [0.1 / 2 * (x / 2 + 1) for x in (1 / 3, 2 / 3, 1, 4 / 3, 5 / 3, 2)] + [0.1] * 3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_example_reaches_the_target_through_launch(launch: type) -> None:
    """The example trains to its 95% target (it exits 1 below it) under `sluice launch -w 2 -s 1`, in 5 of its 12
    epochs (it passes 95% in the third)."""
    job = launch(["-w", "2", "-s", "1", *preloads.KERAS,
                  "--", sys.executable, str(ROOT / "examples" / "train_digits_keras.py"),
                  "--epochs", "5"])
    code = job.finish(140)
    assert code == 0, job.stdout()[-2000:] + job.stderr()[-3000:]
    epochs = [line for line in job.stdout().splitlines() if line.startswith("[worker 0] epoch")]
    assert len(epochs) == 5 and float(epochs[-1].split("test accuracy")[1].split("%")[0]) >= 95.0, epochs
