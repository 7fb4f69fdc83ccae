"""One process of bench/pipeline.py: a pipeline stage under Sluice or torch.distributed.pipelining (gloo).

    sluice launch -w P -s 0 -- python bench/pipeline_job.py --side sluice --stages P ...
    RANK=r WORLD_SIZE=P MASTER_ADDR=127.0.0.1 MASTER_PORT=... python bench/pipeline_job.py --side torch ...

Both sides run the same stage module (or V chunks: chunk c of stage s is virtual stage c * P + s),
batches, schedule and optimizer with the same call (`step(x)` / `step(target=y, losses=l)` / `step()`);
only the pipelining library differs. Each process
prints one line `PIPELINE_BENCH {json}`: its stage, the busy and wall seconds of each timed step
(model "sleep"), the seconds of each timed repetition (model "mlp", first stage), the CPU seconds of
all its threads over the timed steps, and the losses of the first and last steps (last stage).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/pipeline_job.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from sluice.worker.pipeline.schedule import SCHEDULES
from sluice.worker.torch.pipelining import split_model

CLASSES = 10
SLEEP_FEATURES = 4


class _Sleep(torch.autograd.Function):
    """The identity, whose forward and backward each sleep a fixed time and count it as the stage's busy time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float, busy: list[float]) -> torch.Tensor:
        if forward_s:
            started = time.perf_counter()
            time.sleep(forward_s)
            busy.append(time.perf_counter() - started)
        ctx.seconds, ctx.busy = backward_s, busy
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        started = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.busy.append(time.perf_counter() - started)
        return grad, None, None, None


class FixedCompute(nn.Module):
    """A stage whose forward takes `seconds` and whose backward takes as long, whatever the input (it
    sleeps: four processes on two cores would otherwise measure the cores, not the schedule): y = x * w,
    the input's branch of the backward sleeping half of it and the weight's the other half, so that a
    backward split into the inputs' gradient (I) and the weights' (W) takes half each (zero bubble). A
    scalar anchor on an input that needs no gradient (the first stage) keeps its branch in the backward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(()))
        self.anchor = nn.Parameter(torch.ones(()))
        self.busy: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:
            x = x * self.anchor
        half = self.seconds / 2
        side: torch.Tensor = _Sleep.apply(x, self.seconds, half, self.busy)  # type: ignore[no-untyped-call]
        weight: torch.Tensor = _Sleep.apply(self.weight, 0.0, half, self.busy)  # type: ignore[no-untyped-call]
        return side * weight


def mlp(width: int, layers: int) -> nn.Sequential:
    """`layers` blocks of Linear(width, width) + ReLU, the last one's Linear giving CLASSES logits instead."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers - 1)]
    blocks.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*blocks)


def batches(args: argparse.Namespace, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` seeded batches the steps cycle through, the same on both sides."""
    generator = torch.Generator().manual_seed(1)
    if args.model == "sleep":
        return [(torch.randn(args.batch, SLEEP_FEATURES, generator=generator), torch.zeros(args.batch, SLEEP_FEATURES))
                for _ in range(count)]
    return [(torch.randn(args.batch, args.width, generator=generator),
             torch.randint(0, CLASSES, (args.batch,), generator=generator)) for _ in range(count)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["sluice", "torch"], required=True, help="which pipelining library")
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages P (= processes)")
    parser.add_argument("--micro", type=int, required=True, help="micro-batches M per step")
    parser.add_argument("--schedule", choices=SCHEDULES, required=True, help="the pipeline schedule")
    parser.add_argument("--virtual", type=int, default=1, help="chunks of the model per stage (interleaved)")
    parser.add_argument("--model", choices=["sleep", "mlp"], required=True,
                        help="sleep: stages of fixed compute; mlp: Linear+ReLU blocks split evenly")
    parser.add_argument("--compute-ms", type=float, default=50.0,
                        help="sleep: forward (and backward) ms per stage, its chunks together")
    parser.add_argument("--width", type=int, default=512, help="mlp: features of every hidden layer")
    parser.add_argument("--layers", type=int, default=8, help="mlp: blocks, a multiple of the virtual stages")
    parser.add_argument("--batch", type=int, default=128, help="samples per step")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repetition")
    parser.add_argument("--repeats", type=int, default=1, help="timed repetitions (mlp)")
    parser.add_argument("--inputs-first", choices=["auto", "on", "off"], default="auto",
                        help="sluice, GPipe and 1F1B: send each backward's inputs' gradient before computing its "
                             "weights' where that measures faster (auto), always (on) or never (off)")
    parser.add_argument("--profile", metavar="PREFIX", help="cProfile the timed steps into PREFIX.rankN.prof")
    return parser.parse_args(argv)


def stage_chunks(args: argparse.Namespace, stage: int) -> list[nn.Module]:
    """Stage `stage`'s chunks: chunk c is virtual stage c * P + stage of V * P (one chunk but interleaved)."""
    parts = args.stages * args.virtual
    if args.model == "sleep":
        return [FixedCompute(args.compute_ms / 1e3 / args.virtual) for _ in range(args.virtual)]
    if args.layers % parts:
        raise SystemExit(f"--layers {args.layers} does not split evenly into {parts} virtual stages")
    per = args.layers // parts
    points = [per * s for s in range(1, parts)]
    chunks: list[nn.Module] = [*split_model(mlp(args.width, args.layers), parts, points=points)[stage::args.stages]]
    return chunks


def setup(args: argparse.Namespace) -> tuple[int, list[nn.Module], Any, Callable[[], None], Callable[[], None]]:
    """(rank, this process's stage chunks, the schedule over them, a barrier, the shutdown) on the chosen side."""
    loss_fn = nn.functional.mse_loss if args.model == "sleep" else nn.functional.cross_entropy
    if args.side == "sluice":
        import sluice.torch as hvd
        from sluice.worker.torch import pipelining as ours

        hvd.init()
        rank = hvd.rank()
        chunks = stage_chunks(args, rank % args.stages)
        mine = ours.PipelineStage(chunks if args.virtual > 1 else chunks[0], None, args.stages)
        first = {"auto": None, "on": True, "off": False}[args.inputs_first]
        schedule = ours.get_schedule_class(args.schedule)(mine, args.micro, loss_fn, inputs_first=first)
        return rank, chunks, schedule, hvd.barrier, hvd.shutdown
    import torch.distributed as dist
    from torch.distributed import pipelining as theirs
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    chunks = stage_chunks(args, rank)
    stages = [theirs.PipelineStage(chunk, c * args.stages + rank, args.stages * args.virtual, torch.device("cpu"))
              for c, chunk in enumerate(chunks)]
    kind = get_schedule_class(args.schedule)  # ours are torch's names in lower case
    schedule = kind(stages[0] if issubclass(kind, PipelineScheduleSingle) else stages, args.micro, loss_fn=loss_fn)
    # the gloo group is never destroyed (the process ends with os._exit): its destructor can hang in
    # torch 2.13 (see bench.common.keep_alive)
    return rank, chunks, schedule, dist.barrier, lambda: None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, chunks, schedule, barrier, shutdown = setup(args)
    stage, first, last = rank % args.stages, rank % args.stages == 0, rank % args.stages == args.stages - 1
    optimizer = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=0.01)
    timed = [chunk for chunk in chunks if isinstance(chunk, FixedCompute)]
    data = batches(args)
    losses: list[float] = []
    busy: list[float] = []
    wall: list[float] = []

    def one_step(index: int) -> None:
        x, y = data[index % len(data)]
        optimizer.zero_grad()
        for chunk in timed:
            chunk.busy.clear()
        started = time.perf_counter()
        if first:
            schedule.step(x)
        elif last:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=step_losses)
            losses.append(float(torch.stack([loss.detach() for loss in step_losses]).mean()))
        else:
            schedule.step()
        wall.append(time.perf_counter() - started)
        if timed:
            busy.append(sum(sum(chunk.busy) for chunk in timed))
        optimizer.step()

    for index in range(args.warmup):
        one_step(index)
    profiler = cProfile.Profile() if args.profile else None
    seconds = []
    cpu = time.process_time()  # every thread's: the library's own threads count too
    index = args.warmup
    sleeping = args.model == "sleep"  # each stage times its own steps: a barrier would only shift the first
    for _ in range(args.repeats):
        if not sleeping:
            barrier()
        if profiler:
            profiler.enable()
        started = time.perf_counter()
        for _ in range(args.steps):
            one_step(index)
            index += 1
        if not sleeping:
            barrier()
        seconds.append(time.perf_counter() - started)
        if profiler:
            profiler.disable()
    cpu = time.process_time() - cpu
    if profiler:
        profiler.dump_stats(f"{args.profile}.rank{rank}.prof")
    result = {"rank": rank, "stage": stage, "seconds": seconds, "cpu": cpu, "busy": busy[args.warmup:],
              "wall": wall[args.warmup:], "losses": [losses[0], losses[-1]] if losses else []}
    print("PIPELINE_BENCH " + json.dumps(result), flush=True)
    shutdown()
    if args.side == "torch":
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # torch's side would otherwise hang in the gloo group's destructor on the way out
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)
