"""A worker script for test_cuda: trains on a device through Sluice and saves its parameters (and what it saw).

With "ops" after the device, it runs Horovod's ops on tensors of that device instead and saves their results."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import sluice.torch as hvd
from sluice.worker.torch.device_hierarchy import made as device_paths
from sluice.worker.torch.state import require
from tests.integration.training import global_batches, make_model, make_optimizer


def main(out_path: str, steps: int, batch: int, device: str) -> None:
    hvd.init()
    if device == "cuda":  # pinned as Horovod's examples pin it: the local rank's GPU, where the host has as many
        pinned = hvd.local_rank() if hvd.local_rank() < torch.cuda.device_count() else 0  # else: the default
        assert torch.cuda.current_device() == pinned, (torch.cuda.current_device(), hvd.local_rank())
    model = make_model().to(device)
    opt = hvd.DistributedOptimizer(make_optimizer(model, "sgd"), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = (t.to(device) for t in global_batches(steps, batch))
    per = batch // hvd.size()
    for step in range(steps):
        start = step * batch + hvd.rank() * per
        opt.zero_grad()
        F.mse_loss(model(x[start : start + per]), y[start : start + per]).backward()
        opt.step()
    hvd.synchronize_parameters()
    arrays = {f"p{i}": p.detach().cpu().numpy() for i, p in enumerate(model.parameters())}
    np.savez(f"{out_path}.{hvd.rank()}.npz", **arrays)
    seen = {"device_resident": sum(path.summed for path in device_paths(require())), "nccl_built": hvd.nccl_built()}
    with open(f"{out_path}.{hvd.rank()}.json", "w") as f:
        json.dump(seen, f)
    hvd.shutdown()


def ops(out_path: str, device: str) -> None:
    """Horovod's ops on `device` tensors: each result stays on the device and is what the CPU arithmetic says."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.arange(6, dtype=torch.float32, device=device) * (rank + 1)
    out: dict[str, Any] = {}
    results = {
        "sum": hvd.allreduce(x, op=hvd.Sum, name="sum"),
        "average": hvd.allreduce(x, name="average"),
        "min": hvd.allreduce(x, op=hvd.Min, name="min"),
        "max": hvd.allreduce(x, op=hvd.Max, name="max"),
        "large": hvd.allreduce(torch.ones(1 << 21, device=device) * (rank + 1), op=hvd.Sum, name="large")[:4],
        "grouped": torch.cat(hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum, name="grouped")),
        "in_place": hvd.allreduce_(x.clone(), op=hvd.Sum, name="in_place"),
        "allgather": hvd.allgather(x[: rank + 1], name="allgather"),
        "broadcast": hvd.broadcast(x, root_rank=size - 1, name="broadcast"),
        "alltoall": hvd.alltoall(torch.arange(2 * size, dtype=torch.float32, device=device) + 100 * rank, name="a2a"),
        "reducescatter": hvd.reducescatter(x[: 2 * size], op=hvd.Sum, name="reducescatter"),
    }
    out["devices"] = sorted({t.device.type for t in results.values()})
    out["values"] = {key: t.cpu().tolist() for key, t in results.items()}
    with open(f"{out_path}.{rank}.json", "w") as f:
        json.dump(out, f)
    hvd.shutdown()


if __name__ == "__main__":
    if sys.argv[-1] == "ops":
        ops(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
