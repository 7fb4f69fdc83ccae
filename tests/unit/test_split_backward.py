"""A stage's backward split into the inputs' gradient (I) and the weights' (W): bit for bit a whole backward's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sluice.worker.torch.pipelining.backward import backward_input, splittable


class Tied(nn.Module):
    """One Linear used twice: its weight lies below two split points, so W runs the input path again."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.head = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.linear(torch.relu(self.linear(x)))))
        return out


class TwoOutputs(nn.Module):
    """A second output that no input leads to: the weights' half starts from its own gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), self.bias * 2


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"mlp": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)),
            "layernorm": nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8)),
            "tied": Tied(), "two_outputs": TwoOutputs()}


def _outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = model(x)
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", ["mlp", "layernorm", "tied", "two_outputs"])
@pytest.mark.parametrize("loss", [False, True])
@pytest.mark.parametrize("first", [False, True])
def test_split_backward_gives_a_whole_backwards_gradients_bit_for_bit(name: str, loss: bool, first: bool) -> None:
    """Two micro-batches, I0 I1 W0 W1 against B0 B1: the same inputs' and weights' gradients, the weights
    untouched until W. `first`: a stage whose inputs need no gradient (I does nothing, W all)."""
    model = _models()[name]
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(m)) for m in range(2)]
    grads = [[torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + m)), torch.ones(8)] for m in range(2)]

    def roots(outs: list[torch.Tensor], m: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        if loss:
            return [sum((o * g).sum() for o, g in zip(outs, grads[m], strict=False))], [None]  # type: ignore[list-item]
        return outs, list(grads[m][:len(outs)])

    want_inputs = []
    for m, batch in enumerate(batches):
        x = batch.clone().requires_grad_(not first)
        tensors, seeds = roots(_outputs(model, x), m)
        torch.autograd.backward(tensors, seeds)
        want_inputs.append(x.grad)
    want = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)

    halves = []
    for m, batch in enumerate(batches):
        x = batch.clone().requires_grad_(not first)
        tensors, seeds = roots(_outputs(model, x), m)
        (got,), weights = backward_input(tensors, seeds, [x])
        assert (got is None) if first else torch.equal(got, want_inputs[m])
        halves.append(weights)
    assert all(p.grad is None for p in model.parameters())  # the weights wait for W
    for weights in halves:
        weights.run()
    assert all(torch.equal(a, b) for a, b in zip((p.grad for p in model.parameters()), want, strict=True))


def test_only_the_weights_branches_run_twice() -> None:
    """Each Linear's matmul keeps the gradient that reached it; W starts there towards its weight and bias alone,
    one engine call per Linear; the post-accumulate hooks (replicas' buckets) fire once per parameter."""
    model = _models()["mlp"]
    x = torch.randn(4, 16, requires_grad=True)
    out = model(x)
    fired: list[int] = []
    for index, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=index: fired.append(i))  # type: ignore[misc]
    _, weights = backward_input([out], [torch.ones_like(out)], [x])
    assert len(weights.seeds) == 3 and not weights.roots
    assert [len(seed.leaves) for seed in weights.seeds] == [2, 2, 2] and all(s.grads for s in weights.seeds)
    weights.run()
    assert sorted(fired) == list(range(6))


def test_a_weight_used_twice_falls_back_to_a_backward_from_the_outputs() -> None:
    model = _models()["tied"]
    x = torch.randn(4, 16, requires_grad=True)
    out = model(x)
    _, weights = backward_input([out], [torch.ones_like(out)], [x])
    assert not weights.seeds and weights.roots == [out]
    assert sorted(id(v) for v in weights.leaves) == sorted(id(p) for p in model.parameters())


def test_a_split_of_our_own_is_done_whole_where_the_weights_half_would_run_the_input_path_again() -> None:
    """GPipe's and 1F1B's backwards split to send the inputs' gradient first (whole_if_inexact): a weight used
    twice makes one whole backward at once, the same gradients as B, nothing left for W."""
    model = _models()["tied"]
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    want_x = x.clone().requires_grad_()
    torch.autograd.backward([model(want_x)], [grad])
    want = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    got_x = x.clone().requires_grad_()
    (got,), weights = backward_input([model(got_x)], [grad], [got_x], whole_if_inexact=True)
    assert got is not None and torch.equal(got, want_x.grad)
    assert not weights.seeds and not weights.roots
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))
    mlp = _models()["mlp"]  # exact: split as ever, the weights waiting for W
    y = torch.randn(4, 16, requires_grad=True)
    _, split = backward_input([mlp(y)], [torch.ones(4, 8)], [y], whole_if_inexact=True)
    assert len(split.seeds) == 3 and all(p.grad is None for p in mlp.parameters())


def test_this_torch_can_start_a_backward_from_a_graph_edge() -> None:
    """The probe the schedules ask before splitting (older torch releases refuse a GradientEdge there: the
    schedules then keep GPipe's and 1F1B's backwards whole and refuse zero bubble with advice)."""
    splittable.cache_clear()
    assert splittable() is True
