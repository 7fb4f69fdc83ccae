"""Horovod's PyTorch API beyond the basic collectives, against real processes: reduce ops and scale
factors, every integer and float dtype, autograd through the collectives, topology and build queries,
what is refused, shutdown then init, DistributedOptimizer's options, and SyncBatchNorm."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork
from tests.integration.horovod_jobs import (
    FLOAT8,
    FLOAT_DTYPES,
    INT_DTYPES,
    adasum_job,
    adasum_vectors,
    async_forms,
    autograd_and_queries,
    batch_norm_reference,
    optimizer_options,
    reduce_ops_and_dtypes,
    single_process_training,
    sparse_embedding,
    sparse_reference,
    sync_batch_norm,
)

prefork.torch_optimizers()  # once here, not in every forked worker

pytestmark = pytest.mark.slow


def test_reduce_ops_scale_factors_and_every_dtype() -> None:
    with LocalCluster(3, 0) as cluster:
        results = cluster.run(reduce_ops_and_dtypes)
    ranks = [np.array([r + 1.0, 5.0 - r, -2.0 * r, 0.5]) for r in range(3)]
    expected = {"sum": sum(ranks), "average": sum(ranks) / 3, "min": np.minimum.reduce(ranks),
                "max": np.maximum.reduce(ranks), "product": np.multiply.reduce(ranks)}
    for out in results:
        for name, want in expected.items():
            assert out[f"op.{name}"] == pytest.approx(want.tolist()), name
        assert out["scaled"] == pytest.approx((sum(ranks) * 2 * 0.25).tolist())
        for dtype in (*INT_DTYPES, *FLOAT_DTYPES):
            assert out[f"sum.{dtype}"] == (str(dtype), [6.0] * 7), dtype
            assert out[f"max.{dtype}"] == [3.0] * 7, dtype
            assert out[f"gather.{dtype}"] == (str(dtype), [1.0] + [2.0] * 2 + [3.0] * 3), dtype
            assert out[f"bcast.{dtype}"] == [2.0] * 7, dtype
        for dtype in FLOAT8:
            assert out[f"sum.{dtype}"] == (str(dtype), [3.0] * 5), dtype  # 0.5 + 1 + 1.5, exact in float8
            assert out[f"bcast.{dtype}"] == [1.5] * 5, dtype
        assert out["bool.max"] == [True, True, False, True]  # a logical or
        assert out["bool.min"] == [False, True, False, False]  # an and
        assert out["bool.gather"] == [True, True, False, False, False, True, False, True, False, True, False, False]
        assert out["fp16"] == out["bf16"] == [6.0] * 3
    summed = (np.arange(7.0) * 6).tolist()  # (1 + 2 + 3) * i; 7 rows over 3 ranks: 3, 2, 2 as Horovod splits
    assert [out["reducescatter"] for out in results] == [summed[:3], summed[3:5], summed[5:]]
    blocks = [[[3.0, 3.0]], [[3.0, 3.0]], [[3.0, 3.0]]]  # 3 rows over 3 ranks: one each
    assert [out["grouped_reducescatter"] for out in results] == [
        [part, block] for part, block in zip([summed[:3], summed[3:5], summed[5:]], blocks, strict=True)]


def test_gradients_flow_through_collectives_and_queries_answer_truthfully() -> None:
    with LocalCluster(3, 0) as cluster:
        results = cluster.run(autograd_and_queries)
    for rank, out in enumerate(results):
        assert out["grad.allreduce_sum"] == [6.0] * 4  # the allreduce (Sum) of the output's gradients
        assert out["grad.allreduce_max"] == ([3.0] * 3 if rank == 2 else [0.0] * 3)  # only the maximum's owner
        assert out["grad.allgather"] == [[float(rank)] * 2] * (rank + 1)  # Horovod's test: own rows of the mean
        assert out["grad.broadcast"] == ([1.0] * 3 if rank == 1 else [0.0] * 3)  # the root's, zero elsewhere
        # one host: local rank is the rank; no MPI, Gloo, NCCL, CCL or ROCm; CUDA tensors are accepted
        assert out["queries"] == [rank, 3, 0, 1, True, False, False, False, False, True, False, False, True]
        not_a_set, comm, partial = out["refused"]
        assert out["adasum"] == [2.25, 2.25]
        assert "PartialDistributedOptimizer is not offered" in partial
        assert "process_set must be a ProcessSet" in not_a_set
        assert "MPI" in comm and "sluice launch" in comm
        assert out["after_shutdown"] == [False, "call init() first"]
        assert out["after_init"] == [True, rank, [3.0, 3.0]]


@pytest.mark.parametrize(("option", "tolerance"), [
    ("none", 1e-6), ("sum", 1e-6), ("predivide", 1e-6), ("passes", 1e-6), ("groups_int", 1e-6),
    ("groups_list", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2),
])
def test_distributed_optimizer_options_match_single_process_training(option: str, tolerance: float) -> None:
    steps, batch = 5, 24
    with LocalCluster(2, 0) as cluster:
        results = cluster.run(optimizer_options, option, steps, batch)
    reference = single_process_training(steps, batch)
    for flat in results:
        assert flat == pytest.approx(reference, abs=tolerance, rel=tolerance), option
    assert results[0] == results[1]  # every rank holds the same parameters


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_are_reduced_by_allgather_or_as_dense(sparse_as_dense: bool) -> None:
    with LocalCluster(2, 0) as cluster:
        results = cluster.run(sparse_embedding, sparse_as_dense, 3)
    reference = sparse_reference(2, 3)
    for weights in results:
        assert weights == pytest.approx(reference, rel=1e-6, abs=1e-6)


def test_sync_batch_norm_matches_batch_norm_over_the_whole_batch() -> None:
    batches = [3, 5]  # ranks with different batch sizes
    with LocalCluster(2, 0) as cluster:
        results = cluster.run(sync_batch_norm, batches)
    reference = batch_norm_reference(batches)
    start = 0
    for rank, out in enumerate(results):
        count = batches[rank]
        np.testing.assert_allclose(out["y"], reference["y"][start:start + count], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out["dx"], reference["dx"][start:start + count], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(out["dw"], reference["parts"][rank]["dw"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(out["db"], reference["parts"][rank]["db"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(out["mean"], reference["mean"], rtol=1e-10)
        np.testing.assert_allclose(out["var"], reference["var"], rtol=1e-10)
        assert math.isclose(out["eval"], reference["eval"][rank], rel_tol=1e-9)
        start += count


def test_async_reducescatter_grouped_allgather_sparse_allreduce_and_reducescatters_gradient() -> None:
    with LocalCluster(3, 0) as cluster:
        results = cluster.run(async_forms)
    summed = [6.0 * i for i in range(7)]  # 7 rows over 3 ranks: 3, 2, 2 as Horovod splits
    blocks = [summed[:3], summed[3:5], summed[5:]]
    for rank, out in enumerate(results):
        assert out["poll_at_once"] is False  # the call returns before the ranks have agreed (Horovod's test)
        assert out["reducescatter"] == blocks[rank]
        assert out["grouped_reducescatter"][0] == [[v / 3] for v in blocks[rank]]  # Average
        assert out["grouped_reducescatter"][1] == [[1.0, 1.0]]  # (0 + 1 + 2) / 3, one row each
        assert out["grouped_allgather"] == [[0.0, 1.0, 1.0, 2.0, 2.0, 2.0], [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]]
        assert out["sparse"] == pytest.approx([1 / 3, 2 / 3, 1.0, 2.0, 0.0])  # values / 3, duplicates summed
        # Horovod's gradient: the allgather of the blocks' gradients, times the size for a sum
        assert out["grad.sum"] == [[3.0, 3.0]] * 6 and out["grad.average"] == [[1.0, 1.0]] * 6
        mine = [rank + 1.0] * 2
        assert out["forms"] == [[6.0, 6.0], [6.0, 6.0], [1.0, 1.0, 2.0, 2.0, 3.0, 3.0], [2.0, 2.0], mine,
                                [18.0, 18.0], [[6.0, 6.0], [12.0, 12.0]], [[6.0, 6.0]], mine, [[6.0, 6.0]],
                                [float(rank), float(rank + 10), float(rank + 20)]], rank


def _adasum_formula(vectors: list[np.ndarray]) -> np.ndarray:
    """Horovod's reference tree of A(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b over adjacent ranks,
    in float64; an odd rank out is carried to the next level."""
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        pairs = []
        for a, b in zip(level[::2], level[1::2], strict=False):
            dot, aa, bb = a @ b, a @ a, b @ b
            pairs.append((1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b)
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_adasum_matches_the_formula(workers: int) -> None:
    import torch

    with LocalCluster(workers, 0) as cluster:
        results = cluster.run(adasum_job)
    tolerance = {"torch.float16": 2e-2, "torch.bfloat16": 2e-2, "torch.float32": 1e-5, "torch.float64": 1e-12}
    for dtype, rtol in tolerance.items():
        parts = [[t.double().numpy().reshape(-1) * 0.5 for t in adasum_vectors(r, getattr(torch, dtype[6:]))]
                 for r in range(workers)]
        for index in range(2):
            want = _adasum_formula([p[index] for p in parts]) * 2.0
            for rank, out in enumerate(results):
                assert np.allclose(out[dtype][index], want, rtol=rtol, atol=rtol), (dtype, index, rank)
                assert out[f"{dtype}.dtype"][index] == dtype
    grads = [np.ones(3) * (r + 1) for r in range(workers)]  # parallel: every level halves their sum
    for out in results:
        assert out["grad"] == pytest.approx(_adasum_formula(grads).tolist())
