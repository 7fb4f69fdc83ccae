"""The optimizer on the servers: the settings a server needs to apply torch's SGD or Adam, and the first values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sluice.errors import SluiceError
from sluice.worker.staging import Staging
from sluice.worker.torch.state import require


def server_options(kind: type, group: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a server needs to apply optimizer class `kind` exactly as torch would for `group`."""
    if group.get("maximize") or group.get("amsgrad"):
        raise SluiceError("server-side optimizers support neither maximize nor amsgrad")
    if kind is torch.optim.SGD:
        options = {"name": "sgd", **{k: group[k] for k in ("lr", "momentum", "dampening", "weight_decay")}}
        return {**as_float(options), "nesterov": bool(group["nesterov"])}
    if kind is torch.optim.Adam:
        beta1, beta2 = group["betas"]
        options = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "eps": group["eps"],
                   "weight_decay": group["weight_decay"]}
        return {"name": "adam", **as_float(options)}
    raise SluiceError(
        f"with worker.optimizer_on = 'server' the servers run SGD or Adam, not {kind.__name__}; "
        "use optimizer_on = 'worker' for any other optimizer"
    )


def as_float(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, str) else float(v)) for k, v in options.items()}


def seed_servers(named: list[tuple[str, torch.Tensor]]) -> None:
    """Give every worker rank 0's parameters through the servers, which keep them as the values their
    optimizer updates."""
    node = require()
    started = []
    for name, tensor in named:
        staging = Staging(tensor)
        started.append((node.ps.broadcast(name, staging.load(tensor), 0), staging, tensor))
    for handle, staging, tensor in started:
        handle.wait()
        staging.store(tensor)
