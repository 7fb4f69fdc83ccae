"""The compute alone of bench/pipeline.py's MLP pipeline, timed per stage without any pipelining library.

    python bench/pipeline_compute.py --stages P --micro M [--virtual V] [--width W --layers L --batch B]

One process, one torch thread, every stage's chunks in turn: nothing passes between stages, no Python
beyond the modules' own calls. bench/pipeline.py runs min(P, cores) of these at once and replays the
schedule at their times (sluice.worker.pipeline.schedule.replay): with P <= cores, the step no
pipelining library can beat on this machine. Prints one line `PIPELINE_COMPUTE {json}`: per virtual
stage the median seconds of a forward (the last stage's with the loss), of a backward, and of that
backward split into the inputs' gradient (I) and the weights' (W) in the proportion their separate
passes take (the first stage's inputs need none); per stage (worker) the median seconds of its
optimizer step and zero_grad.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/pipeline_compute.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from bench.pipeline_job import batches, mlp
from sluice.worker.torch.pipelining import split_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages P")
    parser.add_argument("--micro", type=int, required=True, help="micro-batches M per step")
    parser.add_argument("--virtual", type=int, default=1, help="chunks of the model per stage (interleaved)")
    parser.add_argument("--width", type=int, default=512, help="features of every hidden layer")
    parser.add_argument("--layers", type=int, default=8, help="blocks, a multiple of P times V")
    parser.add_argument("--batch", type=int, default=128, help="samples per step")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    args = parser.parse_args(argv)
    args.model = "mlp"  # for bench.pipeline_job.batches
    return args


def split_share(chunk: nn.Module, inputs: torch.Tensor, grad: torch.Tensor | None, target: torch.Tensor | None,
                repeats: int = 5) -> float:
    """The inputs' gradient's share of the chunk's backward (0 when its inputs need none): the median
    time of that pass over the sum of it and the weights' pass, each run alone on a fresh forward."""
    if not inputs.requires_grad:
        return 0.0
    params = list(chunk.parameters())
    shares = []
    for _ in range(repeats):
        out = chunk(inputs)
        if target is not None:
            out = nn.functional.cross_entropy(out, target)
        started = time.perf_counter()
        torch.autograd.grad(out, [inputs], grad, retain_graph=True)
        middle = time.perf_counter()
        torch.autograd.grad(out, params, grad)
        ended = time.perf_counter()
        shares.append((middle - started) / (ended - started))
    return statistics.median(shares)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    parts = args.stages * args.virtual
    per = args.layers // parts
    chunks = split_model(mlp(args.width, args.layers), parts, points=[per * s for s in range(1, parts)])
    optimizers = [torch.optim.SGD([p for chunk in chunks[stage::args.stages] for p in chunk.parameters()], lr=0.01)
                  for stage in range(args.stages)]
    x, y = batches(args, count=1)[0]
    micro = list(zip(torch.tensor_split(x, args.micro), torch.tensor_split(y, args.micro), strict=True))
    forward: list[list[float]] = [[] for _ in chunks]
    backward: list[list[float]] = [[] for _ in chunks]
    optimizer_s: list[list[float]] = [[] for _ in optimizers]
    shares = [0.0] * parts
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        for inputs, target in micro:
            held: list[tuple[torch.Tensor, torch.Tensor]] = []
            for index, chunk in enumerate(chunks):
                if index:
                    inputs = held[-1][1].detach().requires_grad_()
                started = time.perf_counter()
                out = chunk(inputs)
                if index == parts - 1:
                    out = nn.functional.cross_entropy(out, target)
                if timed:
                    forward[index].append(time.perf_counter() - started)
                held.append((inputs, out))
            grad: torch.Tensor | None = None
            for index in reversed(range(parts)):
                inputs, out = held[index]
                if step == args.warmup and target is micro[0][1]:
                    shares[index] = split_share(chunks[index], inputs, grad, target if index == parts - 1 else None)
                started = time.perf_counter()
                torch.autograd.backward([out], None if grad is None else [grad])
                if timed:
                    backward[index].append(time.perf_counter() - started)
                grad = inputs.grad
        for stage, optimizer in enumerate(optimizers):
            started = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            if timed:
                optimizer_s[stage].append(time.perf_counter() - started)
    b = [statistics.median(values) for values in backward]
    result = {"forward": [statistics.median(values) for values in forward], "backward": b,
              "input_grad": [t * share for t, share in zip(b, shares, strict=True)],
              "weight_grad": [t * (1 - share) for t, share in zip(b, shares, strict=True)],
              "optimizer": [statistics.median(values) for values in optimizer_s]}
    print("PIPELINE_COMPUTE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
