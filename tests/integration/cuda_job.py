"""A worker script for test_cuda: trains on a device through Sluice and saves its parameters."""

from __future__ import annotations

import sys

import numpy as np
import torch.nn.functional as F

import sluice.torch as hvd
from tests.integration.training import global_batches, make_model, make_optimizer


def main(out_path: str, steps: int, batch: int, device: str) -> None:
    hvd.init()
    if device == "cuda":  # pinned as Horovod's examples pin it: the local rank's GPU, where the host has as many
        import torch

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
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
