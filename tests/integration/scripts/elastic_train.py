"""Horovod's elastic shape on Sluice: a small model trained step by step, committing after each step.

Each step takes, for worker `rank` of `size`, rows (step * size + rank) * 8 ... + 8 of a fixed data
set, and the learning rate is 0.05 x size (a reset callback sets it after each re-forming), so a run
is determined by which size trained which steps. Prints `ELASTIC_START {generation, size, step}` when
a generation starts training and `ELASTIC_RESULT {rank, size, params}` at the end.
--die-at S --die-rank R: worker R SIGKILLs itself right after its commit of step S (a worker lost).
--stop-at S --save PATH: stop after step S and save the state (rank 0), for a reference run;
--load PATH: start from such a state.
--save-start PATH: rank 0 saves, as --save does, the state each generation after the first starts from.
--pause S: each step of generation 0 sleeps S seconds after its commit (time for the launcher to find a slot).
--setup S: sleep S seconds before hvd.init(), standing for what a real worker sets up once (reading its
dataset, a CUDA context, data loader processes).
--kill-scheduler-at S: worker 0 SIGKILLs the job's scheduler after its commit of step S (a standby takes over).
--process-set: hvd.init(process_sets=[ProcessSet([0, 2])]); each step its members allreduce their rank over it;
and the training function adds ProcessSet([1, 2]) each time it is called (Horovod's examples add sets inside
hvd.elastic.run too), whose members allreduce over it each step
(a sum of 2), and ELASTIC_RESULT lists what each got (`set_sums`).
--times: rank 0 prints `ELASTIC_STEP {step, t}` as each step ends, the dying worker `ELASTIC_DIE {t}` (wall
clock seconds), for bench/replace_worker.py.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
from scheduler_kill import kill_scheduler  # beside this script

import sluice.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--die-rank", type=int, default=-1)
parser.add_argument("--stop-at", type=int, default=-1)
parser.add_argument("--save", default="")
parser.add_argument("--load", default="")
parser.add_argument("--save-start", default="")
parser.add_argument("--pause", type=float, default=0.0)
parser.add_argument("--times", action="store_true")
parser.add_argument("--setup", type=float, default=0.0)
parser.add_argument("--kill-scheduler-at", type=int, default=-1, metavar="S")
parser.add_argument("--process-set", action="store_true")
args = parser.parse_args()
time.sleep(args.setup)

even = hvd.ProcessSet([0, 2])
hvd.init(process_sets=[even] if args.process_set else None)
set_sums: list[float] = []
odd_sums: list[float] = []
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
generator = torch.Generator().manual_seed(1)
x, y = torch.randn(4096, 12, generator=generator), torch.randn(4096, 3, generator=generator)
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, batch=0)
if args.load:
    saved = torch.load(args.load)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.batch = saved["batch"]
    state.commit()


def save_state(path: str) -> None:
    """What --load reads: the parameters, the optimizer's state and the next step."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "batch": state.batch}, path)


def set_lr() -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.05 * hvd.size()


set_lr()
state.register_reset_callbacks([set_lr])


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    rank, size = hvd.rank(), hvd.size()
    odd = hvd.add_process_set([1, 2]) if args.process_set else None  # again after each re-forming, as in Horovod
    generation = int(os.environ.get("SLUICE_ELASTIC_GENERATION", "0"))
    print("ELASTIC_START " + json.dumps({"generation": generation, "size": size, "step": state.batch, "rank": rank,
                                         "pid": os.getpid(), "ppid": os.getppid()}), flush=True)
    if args.save_start and generation > 0 and rank == 0:
        save_state(args.save_start)
    while state.batch < args.steps:
        step = state.batch
        start = (step * size + rank) * 8
        optimizer.zero_grad()
        F.mse_loss(model(x[start:start + 8]), y[start:start + 8]).backward()
        if args.process_set and even.included():  # a set registered again in place, or by the newcomer's init
            set_sums.append(float(hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=even,
                                                name=f"even.{step}").item()))
        if odd is not None and odd.included():
            odd_sums.append(float(hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=odd,
                                                name=f"odd.{step}").item()))
        optimizer.step()
        state.batch = step + 1
        state.commit()
        if args.times and rank == 0:
            print("ELASTIC_STEP " + json.dumps({"step": step, "t": time.time()}), flush=True)
        if step == args.die_at and rank == args.die_rank:
            if args.times:
                print("ELASTIC_DIE " + json.dumps({"t": time.time()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.kill_scheduler_at and rank == 0:
            kill_scheduler(step)
        if step == args.stop_at:
            break
        if args.pause and generation == 0:
            time.sleep(args.pause)


train(state)
hvd.synchronize_parameters()
if args.save and hvd.rank() == 0:
    save_state(args.save)
params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
print("ELASTIC_RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "set_sums": set_sums,
                                     "odd_sums": odd_sums, "params": params}), flush=True)
hvd.shutdown()
