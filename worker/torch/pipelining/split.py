"""Cut a model into pipeline stages: at given points, or balancing parameter bytes or measured time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from sluice.worker.pipeline.schedule import balanced_split

BALANCE = ("params", "time")


def layers_of(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers a model is cut between: an nn.Sequential's children, or the modules of a list."""
    if isinstance(model, nn.Sequential):
        return list(model.children())
    if isinstance(model, nn.Module):
        raise TypeError(f"split_model cuts an nn.Sequential or a list of modules, not a {type(model).__name__}: "
                        "write the model as nn.Sequential(...) of its blocks, or pass the blocks as a list")
    layers = list(model)
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise TypeError("split_model takes a list of nn.Module")
    return layers


def parameter_bytes(layers: Sequence[nn.Module]) -> list[float]:
    return [float(sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in layers]


def measured_seconds(layers: Sequence[nn.Module], sample: torch.Tensor | tuple[torch.Tensor, ...],
                     repeats: int = 3) -> list[float]:
    """Each layer's forward plus backward time on `sample` (the first layer's input), the median of
    `repeats` runs after one warm-up; layers run in order, each on the previous one's output."""
    times = []
    inputs = sample if isinstance(sample, tuple) else (sample,)
    for layer in layers:
        runs = []
        for _ in range(repeats + 1):
            fresh = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
            start = time.perf_counter()
            out = layer(*fresh)
            outs = out if isinstance(out, tuple) else (out,)
            floats = [o for o in outs if o.requires_grad]
            if floats:
                torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
            if torch.cuda.is_available() and any(o.is_cuda for o in outs):
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        times.append(statistics.median(runs[1:]))
        inputs = tuple(o.detach() for o in outs)
    return times


def split_points(layers: Sequence[nn.Module], stages: int, balance: str = "params",
                 sample: torch.Tensor | tuple[torch.Tensor, ...] | None = None) -> list[int]:
    """The index of each stage's first layer, balancing `balance` ("params": parameter bytes; "time":
    forward and backward time measured on `sample`) so that the heaviest stage is as light as can be."""
    if balance == "params":
        costs = parameter_bytes(layers)
        if not any(costs):
            raise ValueError("these layers have no parameters to balance: pass points=... or balance='time'")
    elif balance == "time":
        if sample is None:
            raise ValueError("balance='time' measures each layer on a sample input: pass sample=<a batch>")
        costs = measured_seconds(layers, sample)
    else:
        raise ValueError(f"balance must be one of {', '.join(BALANCE)}, got {balance!r}")
    return balanced_split(costs, stages)


def split_model(model: nn.Module | Sequence[nn.Module], stages: int, *, points: Sequence[int] | None = None,
                balance: str = "params",
                sample: torch.Tensor | tuple[torch.Tensor, ...] | None = None) -> list[nn.Sequential]:
    """`model` (an nn.Sequential or a list of modules) as `stages` consecutive nn.Sequential stages.

    `points`: the index of each stage's first layer but the first (e.g. [2, 5] cuts 7 layers as 0-1,
    2-4, 5-6). Without them, the cut balances `balance` ("params" or "time": see `split_points`).
    The stages share the model's modules: every process builds the whole model with the same seed
    and keeps its own stage, so all stages start from the same weights as the model would.
    """
    layers = layers_of(model)
    if points is None:
        starts = split_points(layers, stages, balance, sample)
    else:
        starts = [0, *points]
        if len(starts) != stages or starts != sorted(set(starts)) or starts[-1] >= len(layers):
            raise ValueError(f"points {list(points)} must be {stages - 1} increasing layer indices "
                             f"in 1..{len(layers) - 1}")
    bounds = [*starts, len(layers)]
    return [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(stages)]
