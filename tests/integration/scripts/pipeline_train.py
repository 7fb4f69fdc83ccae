"""A pipeline-parallel training job for the tests: an MLP of ReLU blocks cut into stages, SGD, seeded data.

sluice launch -w P*R -s 0 -- python tests/integration/scripts/pipeline_train.py --stages P ...
Each worker prints `PIPELINE_RESULT {json}`: its stage, replica, parameters after the last step (by
chunk: with --virtual V each worker runs V chunks of the model, chunk c being virtual stage c * P + s),
the most micro-batches it held, the compression ratios and (last stage) the losses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import sluice.torch as hvd
from sluice.worker.pipeline.schedule import SCHEDULES
from sluice.worker.torch.pipelining import PipelineStage, get_schedule_class, split_model

WIDTH, CLASSES, INPUTS = 32, 10, 16


def make_model(layers: int = 4, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(INPUTS, width), nn.ReLU()]
    for _ in range(layers - 2):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    blocks.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*blocks)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: `size` samples (every replica takes its own contiguous share)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, INPUTS, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator)


class Checkpointed(nn.Module):
    """A module whose forward is recomputed in its backward, by torch's reentrant checkpoint (which refuses
    torch.autograd.grad: a split backward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=True)
        return out


def train(argv: list[str] | None = None) -> dict[str, Any]:
    """Train as the command line `argv` says (sys.argv when None); this worker's result, before hvd.shutdown().
    The tests also call it in workers they fork themselves (testbed/cluster.py)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual", type=int, default=1, help="chunks of the model per worker (interleaved)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="samples per replica per step")
    parser.add_argument("--compress", choices=["on", "off", "auto"], default="auto")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--no-lean", action="store_true", help="with --offload: ReLUs keep their outputs, as torch's")
    parser.add_argument("--offload-zvc", action="store_true", help="with --offload: ZVC-encode what is offloaded")
    parser.add_argument("--no-direct", action="store_true", help="no direct lanes: through the transport")
    parser.add_argument("--inputs-first", choices=["auto", "on", "off"], default="auto",
                        help="GPipe, 1F1B: send the inputs' gradient before computing the weights'")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--grow-at", type=int, default=-1, help="from this step on, batches are twice as large")
    parser.add_argument("--bad-stage", type=int, default=-1, help="this stage expects inputs one wider than it gets")
    parser.add_argument("--stall-stage", type=int, default=-1, help="this stage stops answering at --stall-at")
    parser.add_argument("--stall-at", type=int, default=2)
    parser.add_argument("--width", type=int, default=WIDTH, help="the hidden layers' width")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (2: one hidden layer)")
    parser.add_argument("--eval-steps", type=int, default=0, help="forward-only steps after training")
    parser.add_argument("--device", default="cpu", help="where every stage runs (cuda: all on the one GPU)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="every stage but the first recomputes its forward in the backward (reentrant checkpoint)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    parts = split_model(make_model(args.layers, args.width), args.stages * args.virtual)
    index = hvd.rank() % args.stages
    if index == args.bad_stage:
        parts[index] = nn.Sequential(nn.Linear(args.width + 1, args.width), *parts[index])
    chunks = [part.to(args.device) for part in parts[index::args.stages]]
    if args.checkpoint and index:
        chunks = [Checkpointed(chunk) for chunk in chunks]
    stage = PipelineStage(chunks[0] if args.virtual == 1 else chunks, None, args.stages, compress=args.compress,
                          offload=args.offload, offload_min_bytes=0,
                          offload_lean=not args.no_lean, offload_compress=args.offload_zvc or None,
                          direct=not args.no_direct)
    inputs_first = {"auto": None, "on": True, "off": False}[args.inputs_first]
    schedule = get_schedule_class(args.schedule)(stage, args.micro, loss_fn=nn.functional.cross_entropy,
                                                 inputs_first=inputs_first)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=args.lr)
    replicas, replica = stage.place.replicas, stage.place.replica
    losses: list[float] = []
    peaks = []
    for step in range(args.steps):
        size = args.batch * (2 if 0 <= args.grow_at <= step else 1)
        x, y = (t.to(args.device) for t in batch(step, size * replicas))
        mine = slice(replica * size, (replica + 1) * size)
        if step == args.stall_at and stage.stage_index == args.stall_stage:
            time.sleep(3600)
        optimizer.zero_grad()
        if stage.is_first and stage.is_last:
            schedule.step(x[mine], target=y[mine])
        elif stage.is_first:
            schedule.step(x[mine])
        elif stage.is_last:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y[mine], losses=step_losses)
            losses.append(float(torch.stack(step_losses).mean()))
        else:
            schedule.step()
        optimizer.step()
        peaks.append(stage.peak_held)
    evaluated = []
    for step in range(args.eval_steps):  # the first stage waits for nothing here but the others' progress
        x, _ = batch(args.steps + step, args.batch * replicas)
        mine = slice(replica * args.batch, (replica + 1) * args.batch)
        out = schedule.eval(x[mine]) if stage.is_first else schedule.eval()
        if stage.is_last:
            evaluated.append(out.reshape(-1).tolist())
    result = {"rank": hvd.rank(), "evaluated": evaluated, "stage": stage.stage_index, "replica": replica,
              "peaks": peaks,
              "unsplittable": stage.unsplittable,
              "early": None if (e := schedule.early) is None else [e.chosen, len(e.whole), len(e.split)],
              "params": [[p.detach().cpu().reshape(-1).tolist() for p in chunk.parameters()] for chunk in chunks],
              "ratio": stage.compression_ratio(), "losses": losses,
              "offloaded": [s.raw_bytes for s in stage.offload_stats], "lean": [s.lean for s in stage.offload_stats],
              "offload_ratio": [s.ratio for s in stage.offload_stats],
              "lanes": stage.exchange.links is not None and all(
                  link.lane is not None for link in stage.exchange.links.links.values())}
    return result


def main() -> int:
    print("PIPELINE_RESULT " + json.dumps(train()), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
