"""A Horovod-style training script for multi-host and recovery jobs: where it ran, the parameters it ended with.

Each worker prints one line `CLUSTER_RESULT {json}`: its ranks as sluice.torch reports them, the
torchrun variables the launcher gave it, the address it listens on, and the final parameters.
With --kill-server-at N, worker 0 SIGKILLs server 0 (--kill-server-rank) of its job in step N, after its
backward pass (its pushes in flight), as a crash would; with --kill-scheduler-at N, the job's scheduler (a sibling
of the workers under a local launcher); with --kill-standby-at N, its first standby; with
--kill-aggregator-at N, aggregator 0 (--kill-aggregator-rank). With --join-rank R, worker R trains
only --join-at steps and waits in hvd.join() while the others go on. With --until-file PATH, the
workers stop once PATH exists (at most --steps steps), agreed by an allreduce in each step so that
all stop at the same step: a job exactly as long as its test needs on any machine. After training,
one more tensor is declared and averaged (`after`): a scheduler that took over must plan it.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from scheduler_kill import kill_scheduler  # beside this script

import sluice.torch as hvd
from sluice.worker.torch.device_hierarchy import made as device_paths
from sluice.worker.torch.state import require

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
parser.add_argument("--kill-server-at", type=int, default=-1, metavar="STEP")
parser.add_argument("--kill-server-rank", type=int, default=0, metavar="RANK")
parser.add_argument("--kill-scheduler-at", type=int, default=-1, metavar="STEP")
parser.add_argument("--kill-aggregator-at", type=int, default=-1, metavar="STEP")
parser.add_argument("--kill-aggregator-rank", type=int, default=0, metavar="RANK")
parser.add_argument("--kill-standby-at", type=int, default=-1, metavar="STEP",
                    help="SIGKILL the first standby scheduler, after a pause of --kill-standby-pause seconds")
parser.add_argument("--kill-standby-pause", type=float, default=0.0, metavar="S")
parser.add_argument("--join-rank", type=int, default=-1, metavar="RANK",
                    help="this worker stops training after --join-at steps and waits in hvd.join() for the others")
parser.add_argument("--join-at", type=int, default=0, metavar="STEP")
parser.add_argument("--until-file", metavar="PATH",
                    help="train until PATH exists (every worker stops at the same step), at most --steps steps")
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--step-sleep", type=float, default=0.0, metavar="S",
                    help="sleep this long in each step (a job slow enough to lose hosts in)")
parser.add_argument("--result-dir", metavar="DIR", help="also write the result to DIR/rank.N.json (a job whose "
                    "launcher is lost prints to no one)")
args = parser.parse_args()


def kill_server(rank: int, role: str = "server") -> None:
    """SIGKILL server (or `role`) `rank` of this job (found by its SLUICE_* variables)."""
    mine = os.environ["SLUICE_SCHEDULER"]
    for proc in Path("/proc").iterdir():
        try:
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
        except (OSError, ValueError):
            continue
        if (environ.get("SLUICE_ROLE"), environ.get("SLUICE_RANK"), environ.get("SLUICE_SCHEDULER")) == (
                role, str(rank), mine) and "sluice.launch.cli" in (proc / "cmdline").read_text():
            os.kill(int(proc.name), signal.SIGKILL)
            step = args.kill_server_at if role == "server" else args.kill_aggregator_at
            print(f"killed {role} {rank} (pid {proc.name}) in step {step}", flush=True)
            return
    raise SystemExit(f"{role} {rank} of this job not found")




hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 3))
base = (torch.optim.Adam(model.parameters(), lr=0.01) if args.optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
generator = torch.Generator().manual_seed(1)
per_worker = 8
x = torch.randn(args.steps * per_worker * size, 12, generator=generator)
y = torch.randn(args.steps * per_worker * size, 3, generator=generator)
for step in range(args.steps):
    if args.until_file and hvd.allreduce(torch.tensor([float(Path(args.until_file).exists())]), op=hvd.Max,
                                         name="until_file").item() > 0:
        break
    if rank == args.join_rank and step == args.join_at:
        break  # fewer batches than the others: hvd.join() below lets them finish
    start = (step * size + rank) * per_worker
    optimizer.zero_grad()
    time.sleep(args.step_sleep)
    F.mse_loss(model(x[start:start + per_worker]), y[start:start + per_worker]).backward()
    if step == args.kill_server_at and rank == 0:
        kill_server(args.kill_server_rank)
    if step == args.kill_scheduler_at and rank == 0:
        kill_scheduler(step)
    if step == args.kill_standby_at and rank == 0:  # the pause: time for it to take over from the scheduler
        time.sleep(args.kill_standby_pause)
        kill_scheduler(step, rank=1)
    if step == args.kill_aggregator_at and rank == 0:
        kill_server(args.kill_aggregator_rank, "aggregator")
    optimizer.step()
hvd.synchronize_parameters()  # with the optimizer on the servers, the last updates may still be landing
if args.join_rank >= 0:
    hvd.join()
tiers = require().hierarchy()
# the sets the fused gradients were summed on in steps (worker/hierarchy.py), and how many groups, or None
hierarchy = None if tiers is None else [tiers.local.members, tiers.cross_ranks, tiers.groups]
result = {
    "rank": rank, "size": size,
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
    "secret_in_env": any("SECRET" in k and k != "SLUICE_SECRET_FD" for k in os.environ),
    "listens_on": json.loads(os.environ["SLUICE_CONFIG_JSON"])["transport"]["host"],
    "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
    "after": hvd.allreduce(torch.full((5,), float(rank)), name="after_training").tolist(),
    # Horovod's API on a large tensor (the hierarchy's, where the job has one): exact in float32
    "large": [bool(torch.equal(hvd.allreduce(torch.arange(1 << 20, dtype=torch.float32) * (rank + 1), op=op),
                               torch.arange(1 << 20, dtype=torch.float32) * want))
              for op, want in ((hvd.Sum, size * (size + 1) // 2), (hvd.Max, size), (hvd.Average, (size + 1) / 2))],
    "groups_after_large": None if tiers is None else tiers.groups,
    "hierarchy": hierarchy,
    # groups that took the device-resident path (collective.local_group): torch's group in the host
    "device_resident": sum(path.summed for path in device_paths(require())),
}
if args.result_dir:
    Path(args.result_dir, f"rank.{rank}.json").write_text(json.dumps(result))
print("CLUSTER_RESULT " + json.dumps(result), flush=True)
hvd.shutdown()
