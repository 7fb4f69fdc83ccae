"""What tests/integration/scripts/cluster_train.py ends with, computed in this process: no job launched.

The script's workers each take 8 rows of a seeded data set per step (worker `rank` of `size`: rows
(step * size + rank) * 8 ... + 8) and apply the average of their gradients; here one process takes
each worker's rows in turn and applies the same average. Same model, seeds, data and optimizer as
the script: a multi-host or SLURM job must end with these parameters, as it would on one machine
(`sluice launch -w SIZE`, which ends with them too: Adam to the bit, SGD to float rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FEATURES, OUTPUTS, PER_WORKER = 12, 3, 8


def cluster_train_params(steps: int, optimizer: str, workers: int, hidden: int = 32) -> list[float]:
    """The parameters cluster_train.py --steps STEPS --optimizer OPTIMIZER --hidden HIDDEN ends with
    on `workers` workers, flattened as its CLUSTER_RESULT lists them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, OUTPUTS))
    step_with = (torch.optim.Adam(model.parameters(), lr=0.01) if optimizer == "adam"
                 else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * PER_WORKER * workers, FEATURES, generator=generator)
    y = torch.randn(steps * PER_WORKER * workers, OUTPUTS, generator=generator)
    params = list(model.parameters())
    for step in range(steps):
        summed = [torch.zeros_like(p) for p in params]
        for rank in range(workers):
            start = (step * workers + rank) * PER_WORKER
            model.zero_grad()
            F.mse_loss(model(x[start:start + PER_WORKER]), y[start:start + PER_WORKER]).backward()
            for total, p in zip(summed, params, strict=True):
                assert p.grad is not None
                total += p.grad
        for total, p in zip(summed, params, strict=True):
            p.grad = total / workers
        step_with.step()
    return torch.cat([p.detach().reshape(-1) for p in params]).tolist()
