"""bench/fusion.py's model (a stack of many small tensors) and what each worker of its jobs trains and times."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.worker.plan.fusion import ALIGN
from testbed.job import emit_result


# ---------------------------------------------------------------------------- the model
class Block(nn.Module):
    """A transformer feed-forward sublayer, post-LayerNorm as in BERT: 2 matrices and 4 vectors."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(x + self.down(F.gelu(self.up(x))))
        return out


CLASSES = 16


def make_model(width: int, blocks: int) -> nn.Sequential:
    return nn.Sequential(*(Block(width) for _ in range(blocks)), nn.Linear(width, CLASSES))


def quarter_buffer(width: int, blocks: int) -> int:
    """A quarter of the fusion buffer the model's gradients fill (slots aligned as the planner aligns
    them), rounded up to the alignment: balanced fusion then cuts it into 4 groups."""
    total = sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in make_model(width, blocks).parameters())
    return -(-total // (4 * ALIGN)) * ALIGN


def model_summary(width: int, blocks: int) -> dict[str, int]:
    sizes = [p.numel() * p.element_size() for p in make_model(width, blocks).parameters()]
    return {"tensors": len(sizes), "model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
            "smallest_tensor_bytes": min(sizes)}


# ---------------------------------------------------------------------------- inside a worker
@dataclass(frozen=True)
class Workload:
    """What every worker of a job trains and times (handed to testbed workers as JSON)."""

    width: int
    blocks: int
    batch: int
    warmup: int
    steps: int
    repeats: int
    verbose: bool = False


def quiet_sluice_logs() -> None:
    """Keep the priority map (200 lines) and metrics out of the output: a handler of our own on the
    "sluice" logger makes the shim leave its level alone."""
    ours = logging.getLogger("sluice")
    ours.addHandler(logging.StreamHandler())
    ours.setLevel(logging.WARNING)


def fusion_worker(work: Workload) -> dict[str, Any]:
    """In a worker of a Sluice job: train, and return per-repetition seconds per step on this rank's
    clock, the fusion plan's group sizes, and the greedy engine's fused buffer sizes per repetition."""
    import sluice.torch as hvd
    from sluice.worker.torch.state import require

    if not work.verbose:
        quiet_sluice_logs()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = make_model(work.width, work.blocks)
    optimizer: Any = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                              named_parameters=model.named_parameters(), model=model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rank = hvd.rank()
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(work.batch, work.width, generator=generator)
    labels = torch.randint(0, CLASSES, (work.batch,), generator=generator)

    def train(count: int) -> float:
        loss = torch.zeros(())
        for _ in range(count):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        return float(loss.item())

    loss = train(work.warmup)
    hvd.synchronize_parameters()
    engine = require().collectives
    greedy = engine.greedy if engine is not None else None
    seconds, buffers = [], []
    for _ in range(work.repeats):
        if greedy is not None:  # every allreduce of the warm-up (or the last repetition) has finished
            greedy.sizes.clear()
        hvd.barrier()
        started = time.perf_counter()
        loss = train(work.steps)
        hvd.synchronize_parameters()
        hvd.barrier()
        seconds.append((time.perf_counter() - started) / work.steps)
        if greedy is not None:
            buffers.append(list(greedy.sizes))
    fused = {id(f): f for f in optimizer._sluice_fused.values()}.values()
    groups = [g.nbytes for f in fused for g in f.plan.groups]
    hvd.shutdown()
    return {"rank": rank, "seconds": seconds, "loss": loss, "groups": groups, "greedy_buffers": buffers}


def worker_main(spec: str) -> int:
    emit_result(fusion_worker(Workload(**json.loads(spec))))
    return 0
