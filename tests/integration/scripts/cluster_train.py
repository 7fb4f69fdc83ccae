"""A Horovod-style training script for multi-host jobs: prints where it ran and the parameters it ended with.

Each worker prints one line `CLUSTER_RESULT {json}`: its ranks as sluice.torch reports them, the
torchrun variables the launcher gave it, the address it listens on, and the final parameters.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

import sluice.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
args = parser.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
base = (torch.optim.Adam(model.parameters(), lr=0.01) if args.optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
generator = torch.Generator().manual_seed(1)
per_worker = 8
x = torch.randn(args.steps * per_worker * size, 12, generator=generator)
y = torch.randn(args.steps * per_worker * size, 3, generator=generator)
for step in range(args.steps):
    start = (step * size + rank) * per_worker
    optimizer.zero_grad()
    F.mse_loss(model(x[start:start + per_worker]), y[start:start + per_worker]).backward()
    optimizer.step()
result = {
    "rank": rank, "size": size,
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
    "secret_in_env": any("SECRET" in k and k != "SLUICE_SECRET_FD" for k in os.environ),
    "listens_on": json.loads(os.environ["SLUICE_CONFIG_JSON"])["transport"]["host"],
    "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
}
print("CLUSTER_RESULT " + json.dumps(result), flush=True)
hvd.shutdown()
