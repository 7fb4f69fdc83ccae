"""Training functions the integration tests run inside forked worker processes."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F

FEATURES, HIDDEN, OUTPUTS = 12, 16, 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS)
    )


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def global_batches(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch, FEATURES, generator=generator)
    y = torch.randn(steps * batch, OUTPUTS, generator=generator)
    return x, y


def train_single(steps: int, batch: int, optimizer: str) -> list[torch.Tensor]:
    """The reference: one process training on the whole global batch of every step."""
    model = make_model()
    opt = make_optimizer(model, optimizer)
    x, y = global_batches(steps, batch)
    for step in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x[step * batch : (step + 1) * batch]), y[step * batch : (step + 1) * batch]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train_distributed(steps: int, batch: int, optimizer: str) -> dict[str, Any]:
    """Each worker trains on its slice of every global batch through Sluice."""
    import worker.torch_shim as hvd

    hvd.init()
    model = make_model()
    if hvd.rank() != 0:  # different start: broadcast_parameters must fix it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = hvd.DistributedOptimizer(make_optimizer(model, optimizer), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = global_batches(steps, batch)
    per = batch // hvd.size()
    digests = []
    for step in range(steps):
        start = step * batch + hvd.rank() * per
        opt.zero_grad()
        F.mse_loss(model(x[start : start + per]), y[start : start + per]).backward()
        opt.step()
        hvd.synchronize_parameters()
        digests.append(digest(model))
    params = [p.detach().clone().numpy() for p in model.parameters()]
    hvd.shutdown()
    return {"params": params, "digests": digests}
