"""Partition planner: chunk sizes, coverage and server balance."""

import random

import pytest

from sluice.scheduler.partition import TensorSpec, plan_tensors


def test_small_table_literal() -> None:
    specs = [TensorSpec("w", (64, 64), "float32"), TensorSpec("b", (64,), "float32")]
    plans, loads = plan_tensors(specs, first_key=0, servers=2, chunk_bytes=1 << 20)
    # 16 KiB + 256 B: whole tensors give 16640 against 0; halves of w give 8192 + 256 against 8192
    assert [p.key for p in plans] == [0, 1]
    assert [p.priority for p in plans] == [0, 1]
    assert [(c.offset, c.length, c.server) for c in plans[0].chunks] == [(0, 2048, 0), (2048, 2048, 1)]
    assert [(c.length, c.server) for c in plans[1].chunks] == [(64, 0)]
    assert loads == [8192 + 256, 8192]


def test_chunks_are_equal_pieces_under_the_cap() -> None:
    spec = TensorSpec("big", (3 * 1024 * 1024 + 5,), "float32")
    plans, _ = plan_tensors([spec], first_key=7, servers=1, chunk_bytes=1 << 20)
    chunks = plans[0].chunks
    assert plans[0].key == 7
    assert len(chunks) == 13  # 12 MiB + 20 bytes: 13 pieces of at most 1 MiB
    assert all(c.length * 4 <= 1 << 20 for c in chunks)
    assert [c.offset for c in chunks] == [i * 241980 for i in range(13)]
    assert sum(c.length for c in chunks) == spec.numel


@pytest.mark.parametrize(
    ("numel", "servers", "chunks"),
    [(65536, 2, 2), (4 << 20, 2, 16), (16 << 20, 4, 64), (1000, 3, 4)],  # 4 KiB: stops at the 1 KiB floor
)
def test_as_few_chunks_as_balance_allows(numel: int, servers: int, chunks: int) -> None:
    plans, _ = plan_tensors([TensorSpec("t", (numel,), "float32")], 0, servers, 1 << 20)
    assert len(plans[0].chunks) == chunks


@pytest.mark.parametrize("seed", range(20))
def test_servers_balanced_within_ten_percent(seed: int) -> None:
    rng = random.Random(seed)
    servers = rng.randint(2, 8)
    specs = [
        TensorSpec(f"t{i}", (rng.randint(1, 3000), rng.randint(1, 300)), rng.choice(["float32", "float16"]))
        for i in range(rng.randint(1, 30))
    ]
    if sum(s.nbytes for s in specs) < servers * 12 * 1024:
        specs.append(TensorSpec("filler", (servers * 12 * 1024,), "float32"))
    plans, loads = plan_tensors(specs, first_key=0, servers=servers, chunk_bytes=1 << 20)
    assert sum(loads) == sum(s.nbytes for s in specs)
    assert max(loads) <= 1.10 * min(loads), loads
    for plan in plans:
        assert sum(c.length for c in plan.chunks) == plan.spec.numel


def test_incremental_plan_continues_from_loads() -> None:
    _first, loads = plan_tensors([TensorSpec("a", (1000,), "float32")], 0, 2, 1 << 20)
    second, loads2 = plan_tensors([TensorSpec("b", (10,), "float64")], 1, 2, 1 << 20, loads)
    assert second[0].key == 1
    assert sum(loads2) == 4000 + 80


def test_scalar_tensor_has_one_chunk() -> None:
    plans, _ = plan_tensors([TensorSpec("s", (), "float32")], 0, 3, 1 << 20)
    assert [(c.offset, c.length) for c in plans[0].chunks] == [(0, 1)]
