"""sluice.tensorflow's alltoall, reducescatter, grouped ops, object ops, Adasum, IndexedSlices: two real workers."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork  # noqa: F401 - imports the forked roles would make
from tests.integration.tf_ops_jobs import ADASUM_DTYPES, adasum_vector, tensorflow_ops, tf_adasum

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs the tensorflow extra")

R = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]  # the reducescatter base, rank 0's
BLOCKS = [slice(0, 3), slice(3, 5)]  # 5 rows over 2 ranks, as Horovod splits them


def _times(rows: list[list[float]], factor: float) -> list[list[float]]:
    return [[v * factor for v in row] for row in rows]


def _adasum(vectors: list[np.ndarray]) -> np.ndarray:
    """Maleki et al.'s A(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, a tree of adjacent ranks, in float64."""
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        pairs = [(1 - a @ b / (2 * (a @ a))) * a + (1 - a @ b / (2 * (b @ b))) * b
                 for a, b in zip(level[::2], level[1::2], strict=False)]
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def _check_adasum(out: dict[str, Any]) -> None:
    tolerance = {"float16": 2e-2, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}
    for dtype in ADASUM_DTYPES:
        import ml_dtypes  # numpy's bfloat16 (TF's dependency): the vectors as each rank's cast made them

        cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        parts = [[adasum_vector(r, i).astype(cast).astype(np.float64) for i in range(2)] for r in range(2)]
        name, single, *grouped = out[f"adasum_{dtype}"]
        assert name == dtype
        rtol = tolerance[dtype]
        assert np.allclose(single, _adasum([p[0] for p in parts]), rtol=rtol, atol=rtol), dtype
        for index in range(2):  # prescale 0.5 before, postscale 2.0 after
            want = _adasum([p[index] * 0.5 for p in parts]) * 2.0
            assert np.allclose(grouped[index], want, rtol=rtol, atol=rtol), (dtype, index)
    want = _adasum([adasum_vector(r, 0) for r in range(2)])
    assert all(np.allclose(got, want, rtol=1e-12) for got in out["adasum_traced"])
    assert np.allclose(out["adasum_grad"], _adasum([np.full(7, 1.0), np.full(7, 2.0)]))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_added_collectives_values_gradients_and_errors_on_two_workers() -> None:
    with LocalCluster(2, 0, {"collective": {"stall_timeout": 10.0}}) as cluster:
        results = cluster.run(tensorflow_ops, timeout=110)
    for rank, out in enumerate(results):
        # alltoall: rank j gets [j, j] once from rank 0 and twice from rank 1; no splits: the tensor alone
        assert out["alltoall"] == [[[rank, rank]] * 3, [1, 2]]
        assert out["alltoall_equal"] == [[0, 1, 10, 11], [2, 3, 12, 13]][rank]
        assert out["alltoall_traced"] == [[[[rank, rank]] * 3, [1, 2]]] * 2
        assert out["alltoall_grad"] == [2 * rank + 1, 2 * rank + 2] * 2 + [0, 0]  # unsent rows: zero
        # reducescatter: rows 0-2 to rank 0, 3-4 to rank 1; the sum of (r + 1) * R is 3 R
        assert out["rs_sum"] == _times(R, 3)[BLOCKS[rank]]
        assert out["rs_average"] == _times(R, 1.5)[BLOCKS[rank]]
        assert out["rs_scaled"] == _times(R, 1.5)[BLOCKS[rank]]  # x2 before the sum, x0.25 after
        assert out["grouped_rs"] == [[3.0, 3.0], [[1.0, 1.0]] * (2 - rank)]
        assert out["rs_traced"] == [[[1.5, 1.5], [[0.5, 0.5]] * (2 - rank), [3.0, 3.0]]] * 2
        # Horovod's gradient: the allgather of the upstream, x size for Sum, x the factors
        assert out["rs_grad_Sum"] == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2
        assert out["rs_grad_Average"] == [[0.5, 0.5]] * 2 + [[1.0, 1.0]] * 2
        assert out["grouped_rs_grad"] == [[2.0, 2.0, 2.0], [[2.0, 2.0], [2.0, 2.0]]]
        # grouped allgather and the gradients of allreduce (Sum, Max), allgather, broadcast
        assert out["gag"] == [[0.0, 1.0, 1.0], [[0, 0], [1, 1]]]
        assert out["gag_traced"] == [out["gag"]] * 2
        assert out["gag_grad"] == [[[1.0, 1.0]], [[2.0, 2.0], [3.0, 3.0]]][rank]
        assert out["collective_grads"] == [[3.0, 3.0], [[0.0, 0.0], [4.0, 4.0]][rank], [1.5, 1.5],
                                           [[0.0, 0.0], [1.5, 1.5]][rank]]
        # objects, never pickled
        assert out["bo"] == [1, (1, "x"), [0, 1, 2], ["bfloat16", [1.0, 1.0]],
                             [{"b": b"\x00\x01", "f": 0.5, "none": None}]]
        assert out["ago"] == [[(r, "x"), [0, r, 2 * r], [float(r)] * 2] for r in range(2)]
        assert out["bo_fn"] == ["call0 from 0", "call1 from 0"]
        assert out["bo_traced"] == 10
        _check_adasum(out)
        # tf.IndexedSlices: gathered (duplicate indices sum when made dense), Average divides the values
        summed = [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 2.0, 3.0]]
        assert out["sparse_sum"] == ["IndexedSlices", summed]
        assert out["sparse_average"] == out["sparse_traced"] == ["IndexedSlices", _times(summed, 0.5)]
        assert out["sparse_grouped"] == [[1.0, 1.0], ["IndexedSlices", summed]]
        table = [[0.5, 0.5], [1.5, 1.5], [0.0, 0.0], [1.0, 1.0]]
        assert out["tape_sparse_as_dense_False"] == out["tape_sparse_traced"] == ["IndexedSlices", table, [0.5]]
        assert out["tape_sparse_as_dense_True"][0] != "IndexedSlices"
        assert out["tape_sparse_as_dense_True"][1:] == [table, [0.5]]
        # errors: Horovod's types; a call one rank cannot run fails on every rank; the next allreduce runs
        expected = {"alltoall_splits_sum": "InvalidArgumentError", "alltoall_equal_split": "InvalidArgumentError",
                    "alltoall_splits_count": "InvalidArgumentError", "alltoall_dtype": "FailedPreconditionError",
                    "alltoall_one_rank_splits": ["InvalidArgumentError", "FailedPreconditionError"][rank],
                    "alltoall_traced_splits": "InvalidArgumentError", "rs_scalar": "ValueError", "rs_op": "ValueError",
                    "rs_shape": "FailedPreconditionError",
                    "grouped_rs_one_rank_scalar": ["ValueError", "FailedPreconditionError"][rank],
                    "gag_dtype": "FailedPreconditionError", "gag_empty": "ValueError",
                    "bo_unsupported_root": ["TypeError", "FailedPreconditionError"][rank],
                    "ago_one_rank_unsupported": ["FailedPreconditionError", "TypeError"][rank],
                    "adasum_int": "ValueError", "adasum_mismatch": "FailedPreconditionError",
                    "sparse_op": "NotImplementedError", "sparse_adasum": "NotImplementedError",
                    "sparse_scale": "NotImplementedError"}
        assert {case: out[case][0] for case in expected} == expected, rank
        assert all(out[case][1] == [3.0, 3.0] for case in expected), rank
        # Horovod's re-exported helpers; its TF1 hook gives every rank rank 1's global variables
        assert out["split_list"] == [[0, 1], [2, 3], [4]] and out["power_of_2"] == [False, True, False, True]
        assert out["average_compat"] == ["sum", "sum", "ValueError"]
        assert out["refs"] == [True, True] and out["queries"] == [False, None]
        assert out["hook"] == [1.0, 1.0], rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_adasum_matches_the_formula_on_3_workers() -> None:
    """An odd rank carried up through TensorFlow's ops (2 workers: the test above; the algorithm on 2, 3 and 4
    workers: test_horovod_api.py's, where a worker costs no TensorFlow import)."""
    workers = 3
    with LocalCluster(workers, 0) as cluster:
        results = cluster.run(tf_adasum, timeout=110)
    vectors = [[adasum_vector(r, i) for i in range(2)] for r in range(workers)]
    for rank, out in enumerate(results):  # 3 ranks: A(A(r0, r1), r2), the odd rank carried up
        assert np.allclose(out["single"], _adasum([v[0] for v in vectors]), rtol=1e-12), rank
        assert np.allclose(out["traced"], _adasum([v[1] for v in vectors]), rtol=1e-12), rank
        for index in range(2):
            want = _adasum([v[index].astype(np.float32).astype(np.float64) * 0.5 for v in vectors]) * 2.0
            assert np.allclose(out["grouped"][index], want, rtol=1e-5, atol=1e-5), (rank, index)
