"""A plain DDP training script (as torchrun runs it); with --sluice, one added line sends its buckets through Sluice."""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--sluice", action="store_true")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 4))
ddp = DDP(model, bucket_cap_mb=0.01)  # small buckets: several per step, so priorities and order matter
if args.sluice:
    import sluice.torch

    ddp.register_comm_hook(None, sluice.torch.ddp_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
generator = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator)
shard = 64 // size
for _ in range(args.steps):
    opt.zero_grad()
    F.mse_loss(ddp(x[rank * shard:(rank + 1) * shard]), y[rank * shard:(rank + 1) * shard]).backward()
    opt.step()
if rank == 0:
    with open(args.out, "w") as file:
        json.dump(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(), file)
dist.barrier()  # no rank tears gloo down while another still uses it
dist.destroy_process_group()
