"""Horovod's collective API over Sluice's allreduce engine, join with uneven batches, stall and mismatch errors."""

from __future__ import annotations

import pytest

from testbed.cluster import LocalCluster
from tests.integration.collective_jobs import horovod_api, mismatches, stall, train_uneven_then_join


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [0, 1])
def test_horovod_collectives_give_horovods_results(servers: int) -> None:
    size = 3
    with LocalCluster(size, servers) as cluster:
        results = cluster.run(horovod_api)
    ranks_sum = sum(range(size))
    base = [float(i) for i in range(10)]
    for rank, out in enumerate(results):
        assert out["average"] == [b + ranks_sum / size for b in base]
        assert out["sum"] == [size * b + ranks_sum for b in base]
        assert out["average_flag"] == out["sum"]
        assert out["in_place"] == out["sum"]
        assert out["async"] == [[float(ranks_sum)] * 4] * 3
        assert out["grouped"] == [[float(ranks_sum)] * 2, [[float(ranks_sum + size)] * 2] * 3]
        assert out["half.torch.float16"] == ("torch.float16", [0.5 * size + ranks_sum])
        assert out["half.torch.bfloat16"] == ("torch.bfloat16", [0.5 * size + ranks_sum])
        assert out["allgather"] == [[float(r)] * 2 for r in range(size) for _ in range(r + 1)]
        assert out["broadcast"] == [1.0] * 4
        assert out["broadcast_object"] == (1, (1, "x"), [0, 1, 2], [1.0, 1.0])
        assert out["allgather_object"] == [(r, "x") for r in range(size)]
        # rank s sent (s + rank) % 3 rows to this rank, starting after the rows it sent to lower ranks
        expected, counts = [], []
        for sender in range(size):
            splits = [(sender + i) % 3 for i in range(size)]
            start = sum(splits[:rank])
            expected += [float(100 * sender + start + i) for i in range(splits[rank])]
            counts.append(splits[rank])
        assert out["alltoall"] == (expected, counts)


@pytest.mark.timeout(120)
def test_join_lets_ranks_with_fewer_batches_finish() -> None:
    with LocalCluster(3, 0) as cluster:
        results = cluster.run(train_uneven_then_join, 4)
        assert cluster.wait() == [0] * 4
    assert [r["last"] for r in results] == [2, 2, 2]


@pytest.mark.timeout(90)
def test_a_stall_names_the_rank_that_did_not_submit() -> None:
    with LocalCluster(3, 0, {"collective": {"stall_timeout": 2.0}}) as cluster:
        errors = cluster.run(stall, 2)
    assert "rank 2" in errors[0] or "ranks 2" in errors[0], errors[0]
    assert "'lonely'" in errors[0]
    assert errors[0] == errors[1]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fusion", ["balanced", "greedy"])
def test_mismatched_collectives_raise_on_every_rank_and_the_job_goes_on(fusion: str) -> None:
    with LocalCluster(3, 0, {"collective": {"fusion": fusion}}) as cluster:
        results = cluster.run(mismatches)
    described = {"shape": ("[[5]]", "[[4]]"), "dtype": ("float64", "float32"), "op": ("sum", "average"),
                 "root": ("root 2", "root 0")}
    for out in results:
        for case, (one, other) in described.items():
            error = out[case]  # rank 1 and one of the others, whichever the two descriptions met at
            assert error.startswith("CollectiveError") and "mismatch" in error, (case, error)
            assert "rank 1 " in error and ("rank 0 " in error or "rank 2 " in error), (case, error)
            assert one in error and other in error, (case, error)
            assert out[f"{case}.after"] == [6.0] * 4  # the same name, agreed: the job went on
        error = out["fused.2"]
        assert error.startswith("CollectiveError") and "'f2' mismatch" in error and "[[6]]" in error, error
        assert [out[f"fused.{i}"] for i in (0, 1, 3)] == [[3.0 + 3 * i] * 4 for i in (0, 1, 3)]
