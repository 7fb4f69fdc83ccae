"""The TF shim's framework-free pieces (worker/tensorflow/fused.py): scaling in wire dtypes, sizes, routes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.reduce import scaled
from sluice.worker.tensorflow.fused import Spec, choose_routes


@pytest.mark.parametrize(
    ("values", "dtype", "factor", "want"),
    [
        (np.array([1.0, -2.0, 3.5], np.float32), "float32", 0.5, [0.5, -1.0, 1.75]),
        (np.array([1.0, 3.0], np.float64), "float64", 1 / 3, [1 / 3, 1.0]),
        (np.array([1.0, 2.0], np.float16), "float16", 0.25, [0.25, 0.5]),
        (np.array([7, -7, 4], np.int32), "int32", 0.5, [3, -3, 2]),  # toward zero
        (np.array([5, 9], np.int64), "int64", 2.0, [10, 18]),
        # bfloat16 patterns: 1.0 = 0x3F80, 3.0 = 0x4040, 0.5 = 0x3F00, 1.5 = 0x3FC0
        (np.array([0x3F80, 0x4040], np.uint16), "bfloat16", 0.5, [0x3F00, 0x3FC0]),
    ],
)
def test_scaled(values: np.ndarray, dtype: str, factor: float, want: list[float]) -> None:
    before = values.copy()
    out = scaled(values, factor, dtype)
    assert out.dtype == values.dtype and out.tolist() == pytest.approx(want)
    assert values.tolist() == before.tolist()  # a new array: the input is never written


def test_scaled_into_out() -> None:
    out = np.zeros(3, np.float32)
    assert scaled(np.array([2.0, 4.0, 6.0], np.float32), 0.5, "float32", out) is out
    assert out.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("spec", "nbytes"),
    [(Spec("w", (3, 4), "float32"), 48), (Spec("b", (), "float64"), 8), (Spec("h", (10,), "bfloat16"), 20),
     (Spec("e", (0, 5), "float32"), 0)],
)
def test_spec_nbytes(spec: Spec, nbytes: int) -> None:
    assert spec.nbytes == nbytes


@dataclass
class _Hosts:
    """What choose_routes reads of a client: where the workers and servers run, and the settings."""

    workers: list[str]
    servers: list[str]
    collective_settings: CollectiveConfig

    def hosts(self, role: str) -> list[str]:
        return self.workers if role == "worker" else self.servers


SPECS = [Spec("a", (100,), "float32"), Spec("b", (75,), "float32"), Spec("c", (50,), "float32"),
         Spec("d", (25,), "float32")]  # 400, 300, 200 and 100 bytes


@pytest.mark.parametrize(
    ("workers", "servers", "settings", "want"),
    [
        (["A", "B"], [], CollectiveConfig(mode="ps"), "aaaa"),  # no servers: all by allreduce
        # 2 worker hosts, 1 server-only host: the servers take half the bytes, largest first
        (["A", "B"], ["C"], CollectiveConfig(), "paaa"),
        (["A", "A"], ["A"], CollectiveConfig(), "aaaa"),  # all on one host: servers add no bandwidth
        (["A", "B"], ["A"], CollectiveConfig(mode="ps"), "pppp"),
        (["A", "B"], ["C"], CollectiveConfig(mode="ps", allreduce_patterns=("c",)), "ppap"),
    ],
)
def test_routes_are_the_torch_shims(workers: list[str], servers: list[str], settings: CollectiveConfig,
                                    want: str) -> None:
    client = _Hosts(workers, servers, settings)
    routes = choose_routes(client, SPECS)  # type: ignore[arg-type]
    assert "".join(routes[s.name][0] for s in SPECS) == want
