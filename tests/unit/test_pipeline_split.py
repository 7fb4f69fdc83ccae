"""split_model: stages at given points, or balancing parameter bytes or measured time."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from sluice.worker.torch.pipelining.split import layers_of, parameter_bytes, split_model, split_points


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8), nn.ReLU(),
                         nn.Linear(8, 2))


def test_points_cut_where_asked_and_the_stages_share_the_modules() -> None:
    model = mlp()
    stages = split_model(model, 3, points=[2, 5])
    assert [len(s) for s in stages] == [2, 3, 2]
    assert stages[1][0] is model[2] and stages[2][1] is model[6]
    x = torch.randn(4, 8)
    staged = x
    for stage in stages:
        staged = stage(staged)
    assert torch.equal(staged, model(x))


def test_parameter_bytes_balance_the_heaviest_stage() -> None:
    model = mlp()
    assert parameter_bytes(layers_of(model)) == [4 * (8 * 64 + 64), 0.0, 4 * (64 * 64 + 64), 0.0,
                                                 4 * (64 * 8 + 8), 0.0, 4 * (8 * 2 + 2)]
    assert split_points(layers_of(model), 2) == [0, 2]  # the 64x64 layer alone outweighs the rest
    assert [len(s) for s in split_model(model, 2)] == [2, 5]


class Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x * self.scale


@pytest.mark.serial
def test_time_balance_measures_each_layer() -> None:
    layers = [Sleep(0.04), Sleep(0.04), Sleep(0.002), Sleep(0.002)]
    assert split_points(layers, 2, "params") == [0, 2]  # equal parameters
    assert split_points(layers, 2, "time", sample=torch.ones(2, 2)) == [0, 1]  # 40 ms | 44 ms
    assert split_points(layers, 3, "time", sample=torch.ones(2, 2)) == [0, 1, 2]


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"points": [5, 2]}, ValueError, "must be 2 increasing layer indices"),
    ({"points": [2]}, ValueError, "must be 2 increasing layer indices"),
    ({"points": [2, 7]}, ValueError, "must be 2 increasing layer indices"),
    ({"balance": "time"}, ValueError, "pass sample="),
    ({"balance": "flops"}, ValueError, "balance must be one of params, time"),
])
def test_refusals(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        split_model(mlp(), 3, **kwargs)  # type: ignore[arg-type]


def test_only_sequential_models_or_lists_are_cut() -> None:
    with pytest.raises(TypeError, match=r"write the model as nn\.Sequential"):
        split_model(nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="no parameters to balance"):
        split_model([nn.ReLU(), nn.ReLU()], 2)
    assert len(split_model([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)], 2)) == 2
