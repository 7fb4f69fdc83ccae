"""The replicas' gradient buckets (worker/torch/pipelining/replicas.py): their cut and launch order.

The data plane is replaced by a recorder that halves each array in place (an average over two
replicas that sent the same gradients): the logic of buckets, hooks and order, without sockets
(tests/integration/test_pipeline.py averages over real replicas).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sluice.worker.torch.pipelining.replicas import ReplicaAverager, cut_buckets


class Halving:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, str]] = []

    def allreduce(self, seq: int, array: np.ndarray, dtype: str, op: str, priority: int) -> Any:
        assert op == "average" and priority == 2
        self.calls.append((seq, array.size, dtype))
        array /= 2
        return self

    def wait(self) -> None:
        pass


def params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(shape, dtype=dtype)) for shape in shapes]


def test_buckets_cut_in_reverse_order_by_bytes_and_dtype() -> None:
    ps = params((10,), (20,), (30,), (300,))
    half = params((5,), dtype=torch.float16)
    assert [[p.numel() for p in b] for b in cut_buckets([*ps, *half], 200)] == [[5], [300], [30, 20], [10]]
    assert [[p.numel() for p in b] for b in cut_buckets(ps, 1 << 20)] == [[300, 30, 20, 10]]


def test_a_bucket_starts_once_its_gradients_are_final_and_in_bucket_order() -> None:
    layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    group = Halving()
    averager = ReplicaAverager(group, list(layers.parameters()), 2, bucket_bytes=8 * 8 * 4 + 8 * 4)
    assert [[p.numel() for p in b] for b in averager.buckets] == [[2, 16, 8], [64, 8], [32]]
    layers(torch.ones(3, 4)).sum().backward()  # not armed: nothing starts
    assert group.calls == []
    averager.arm()
    layers(torch.ones(3, 4)).sum().backward()  # armed: each bucket as soon as its gradients are, in order
    assert group.calls == [(0, 26, "float32"), (1, 72, "float32"), (2, 32, "float32")]
    expected = [p.grad.clone() / 2 for p in layers.parameters()]  # type: ignore[union-attr]
    averager.finish()
    assert all(torch.equal(p.grad, want) for p, want in zip(layers.parameters(), expected, strict=True))


def test_unused_parameters_add_zeros_and_start_at_finish() -> None:
    used, unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    group = Halving()
    averager = ReplicaAverager(group, [*used.parameters(), *unused.parameters()], 2, bucket_bytes=16)
    averager.arm()
    used(torch.ones(1, 2)).sum().backward()
    assert [seq for seq, _, _ in group.calls] == []  # the first buckets (reverse order) are the unused layer's
    averager.finish()
    assert [(seq, n) for seq, n, _ in group.calls] == [(0, 2), (1, 4), (2, 2), (3, 4)]
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in unused.parameters())
    assert torch.equal(used.bias.grad, torch.full((2,), 0.5))  # type: ignore[arg-type]
