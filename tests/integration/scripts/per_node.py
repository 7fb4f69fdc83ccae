"""A training script as torchrun runs it on each machine: Sluice's allreduce and torch.distributed's own (gloo, from
the torchrun variables); with `fail`, rank 3 fails before its first collective (with `fail-once`, in the job's first
start only: --max-restarts); with `long`, each rank says its pid
and goes on with allreduces for a minute."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import sluice.torch as hvd

hvd.init()
if sys.argv[1:] == ["fail"] and hvd.rank() == 3:
    raise RuntimeError("rank 3 fails on purpose")
if sys.argv[1:] == ["fail-once"] and hvd.rank() == 3 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    raise RuntimeError("rank 3 fails on the first start")
ours = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
if sys.argv[1:] == ["long"]:  # the test kills one machine's launcher meanwhile
    print("RUNNING", hvd.rank(), os.getpid(), flush=True)
    for _ in range(1200):
        hvd.allreduce(torch.ones(1000))
        time.sleep(0.05)
    sys.exit(0)
dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun sets them
theirs = torch.tensor([float(dist.get_rank())])
dist.all_reduce(theirs)
dist.destroy_process_group()
print("RESULT", hvd.rank(), hvd.size(), os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"],
      os.environ["GROUP_RANK"], ours, theirs.item(), os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
