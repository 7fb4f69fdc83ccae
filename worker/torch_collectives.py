"""Collectives of the PyTorch shim: allreduce and broadcast of tensors, parameters and optimizer state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from worker.staging import Staging
from worker.torch_state import NAMES, declare_missing, require


def allreduce_(tensor: torch.Tensor, name: str | None = None, average: bool = True) -> torch.Tensor:
    """Sum (or average) `tensor` over all workers, in place."""
    name = name or f"allreduce.{next(NAMES)}"
    declare_missing([(name, tensor)])
    staging = Staging(tensor)
    data = staging.load(tensor)
    require().push_pull(name, data, data).wait()
    staging.store(tensor)
    if average:
        tensor.div_(require().size)
    return tensor


def allreduce(tensor: torch.Tensor, name: str | None = None, average: bool = True) -> torch.Tensor:
    return allreduce_(tensor.detach().clone(), name, average)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    broadcast_parameters([(name or f"broadcast.{next(NAMES)}", tensor)], root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    return broadcast_(tensor.detach().clone(), root_rank, name)


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int
) -> None:
    """Overwrite every worker's tensors with `root_rank`'s (a state_dict or named_parameters)."""
    named = list(params.items()) if isinstance(params, Mapping) else list(params)
    declare_missing(named)
    client = require()
    started = []
    for name, tensor in named:
        staging = Staging(tensor)
        started.append((client.broadcast(name, staging.load(tensor), root_rank), staging, tensor))
    for handle, staging, tensor in started:
        handle.wait()
        staging.store(tensor)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every worker `root_rank`'s optimizer state and numeric hyper-parameters."""
    named: list[tuple[str, torch.Tensor]] = []
    scalars: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for index, group in enumerate(optimizer.param_groups):
        for key, value in sorted(group.items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                holder = torch.tensor([float(value)], dtype=torch.float64)
                scalars.append((group, key, holder))
                named.append((f"optimizer.group{index}.{key}", holder))
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for param, state in optimizer.state.items():
        for key, value in sorted(state.items()):
            if torch.is_tensor(value):
                named.append((f"optimizer.state{order[id(param)]}.{key}", value))
    broadcast_parameters(named, root_rank)
    for group, key, holder in scalars:
        group[key] = type(group[key])(holder.item())
