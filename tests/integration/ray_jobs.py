"""The training function the Ray Train test runs on each Ray worker, and its single-process reference."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

FEATURES, ROWS, LR = 8, 64, 0.1


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    return x, x @ torch.randn(FEATURES, 1, generator=generator)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def reference(steps: int) -> list[list[float]]:
    """Plain SGD on the whole batch: what averaged gradients of equal shards must reproduce."""
    net, (x, y) = model(), data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in net.parameters()]


def train(config: dict[str, Any]) -> None:
    """Runs in each Ray worker: `import sluice.torch as hvd` as a Horovod script would, a shard per rank."""
    import sluice.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    net, (x, y) = model(), data()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR),
                                         named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    shard = slice(rank * ROWS // size, (rank + 1) * ROWS // size)
    losses = []
    for _ in range(config["steps"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x[shard]), y[shard])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    hvd.synchronize_parameters()  # the last step's update lands before the next forward pass, or here
    params = [p.detach().flatten().tolist() for p in net.parameters()]
    record = {"rank": rank, "size": size, "local_rank": hvd.local_rank(), "losses": losses, "params": params,
              "all_params": hvd.allgather_object(params), "env_rank": os.environ.get("RANK"),
              "scheduler": os.environ.get("SLUICE_SCHEDULER"), "routes": getattr(optimizer, "_sluice_routes", {}),
              "secret_in_environ": any("SECRET" in k and k != "SLUICE_SECRET_FD" for k in os.environ)}
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(record))
    if config.get("fail_rank") == rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")


class Executable:
    """Horovod's test_ray.py `Executable`: the object RayExecutor.start(executable_cls=...) builds in each worker."""

    def __init__(self, epochs: int) -> None:
        import sluice.torch as hvd

        self.hvd = hvd
        self.epochs = epochs
        self.hvd.init()

    def rank_epoch(self) -> int:
        return int(self.hvd.rank()) * self.epochs


def rank_times(num_epochs: int) -> int:
    """Horovod's test_ray.py `simple_fn` for RayExecutor.run."""
    import sluice.torch as hvd

    hvd.init()
    return int(hvd.rank()) * num_epochs
