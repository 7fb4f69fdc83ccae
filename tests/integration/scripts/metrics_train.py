"""Trains a small model in two phases and waits between them, so a test can scrape every process's metrics.

Each worker trains --steps steps, prints `PHASE 1 DONE <rank>`, waits for the file --go to exist, trains
--steps more, prints `PHASE 2 DONE <rank>`, waits for --end, and ends. Every wait has a deadline.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sluice.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--go", type=Path, required=True)
parser.add_argument("--end", type=Path, required=True)
args = parser.parse_args()


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.05)


hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(8, 12), torch.randn(8, 3)
for phase, wait in ((1, args.go), (2, args.end)):
    for _ in range(args.steps):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    print(f"PHASE {phase} DONE {hvd.rank()}", flush=True)
    wait_for(wait)
hvd.shutdown()
