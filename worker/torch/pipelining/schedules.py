"""Pipeline schedules that run a stage's micro-batches: GPipe, 1F1B, interleaved 1F1B and zero bubble.

ScheduleGPipe (fill-drain), Schedule1F1B, ScheduleInterleaved1F1B (V chunks per stage) and
ScheduleInterleavedZeroBubble (the backward split into I and W; ZB-H1 with one chunk per stage), named
as torch.distributed.pipelining's. Each stage runs its own order of forwards and backwards
(worker/pipeline/schedule.py, interleave.py); stages meet
only through the activations and gradients they send each other, so no clock is shared and a slow
stage delays only those that wait on it. The call mirrors
torch.distributed.pipelining: `step(x)` on the first stage, `step(target=y, losses=losses)` on the
last, `step()` in between; then the user's optimizer steps the stage's own parameters. GPipe's and
1F1B's backwards send their inputs' gradient before computing their weights' where the stage's trial
steps measure that faster (early.py). With replicas,
the stage's gradients are averaged in buckets while its last backward runs (replicas.py).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from sluice.errors import SluiceError
from sluice.worker.pipeline.schedule import SPLIT_BACKWARD, canonical, schedule
from sluice.worker.torch.pipelining.backward import splittable
from sluice.worker.torch.pipelining.early import EarlyInputs
from sluice.worker.torch.pipelining.replicas import ReplicaAverager
from sluice.worker.torch.pipelining.stage import REPLICA_PRIORITY, PipelineStage

log = logging.getLogger("sluice.worker")


def _chunks(value: Any, micro: int, what: str) -> list[Any]:
    """`value` cut along dim 0 into `micro` parts (a tensor), or the same for every micro-batch."""
    if not isinstance(value, torch.Tensor):
        return [value] * micro
    if value.dim() == 0 or value.shape[0] < micro:
        raise SluiceError(f"{what} of shape {list(value.shape)} cannot be cut into {micro} micro-batches along "
                          "its first dimension: give at least one sample per micro-batch")
    return list(torch.tensor_split(value, micro))


class PipelineSchedule:
    """Runs `n_microbatches` micro-batches a step through `stage` in the schedule's order."""

    name = ""

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None, *, scale_grads: bool = True,
                 inputs_first: bool | None = None) -> None:
        """`loss_fn(output, target)` runs on the last stage for each micro-batch; `scale_grads` divides its
        gradients by the number of micro-batches, so that a mean loss gives the gradients of the whole batch.
        `inputs_first` (GPipe, 1F1B, interleaved 1F1B): each backward with a stage before it computes and
        sends its inputs' gradient before its weights' (the stage before starts its backward sooner:
        schedule.inputs_first; the same gradients, bit for bit): None, where that measures faster
        (early.EarlyInputs); True, always; False, never. Not with offload, which takes a whole backward."""
        if stage.is_last and loss_fn is None:
            raise SluiceError(f"{stage.describe()} is the last stage: give the schedule a loss_fn(output, target)")
        self.stage, self.micro, self.loss_fn, self.scale_grads = stage, n_microbatches, loss_fn, scale_grads
        if self.name in SPLIT_BACKWARD and stage.offload:
            raise SluiceError(f"{stage.describe()}: {type(self).__name__} splits the backward in two, which unpacks "
                              "what the forward saved twice; offload takes a whole backward: "
                              "PipelineStage(offload=False)")
        try:
            orders = schedule(self.name, stage.num_stages, n_microbatches, stage.virtual)
        except ValueError as exc:
            raise SluiceError(f"{stage.describe()}: {type(self).__name__}: {exc}") from exc
        stages = stage.num_stages
        if (self.name in SPLIT_BACKWARD or inputs_first) and not splittable():
            raise SluiceError(f"{stage.describe()}: {type(self).__name__}"
                              f"{'' if self.name in SPLIT_BACKWARD else '(inputs_first=True)'} splits each backward "
                              f"in two, which torch {torch.__version__} cannot do (a backward from a graph edge): "
                              "upgrade torch, or take Schedule1F1B")
        #: whether a step's backwards send the inputs' gradient first (None: they never do here)
        self.early = None if (self.name in SPLIT_BACKWARD or stage.offload or inputs_first is False
                              or (stage.is_first and stage.virtual == 1) or not splittable()) else (
            EarlyInputs(inputs_first))
        #: this stage's actions in order: (kind, micro-batch, chunk)
        self.order = [(a.kind, a.micro, 0 if a.stage is None else a.stage // stages)
                      for a in orders[stage.stage_index]]
        self.steps = 0
        group = stage.exchange.group
        #: with replicas, each stage averages its gradients with theirs while its last backward runs (the chunk
        #: of that backward last in the list: its parameters make the first buckets)
        last = self.order[-1][2]
        params = [p for c, chunk in enumerate(stage.chunks) if c != last for p in chunk.parameters()]
        self.replicas = None if group is None else ReplicaAverager(
            group, params + list(stage.chunks[last].parameters()), REPLICA_PRIORITY)

    def step(self, *args: Any, target: Any = None, losses: list[torch.Tensor] | None = None) -> Any:
        """One training step's forwards and backwards (gradients accumulate in the stage's parameters, as
        for a whole batch); on the last stage the outputs of the micro-batches concatenated, else None.
        `losses` (last stage) gets each micro-batch's loss."""
        return self._run(args, target, losses, train=True)

    def eval(self, *args: Any, target: Any = None, losses: list[torch.Tensor] | None = None) -> Any:
        """The forwards alone, without autograd (evaluation); every stage calls it where the others do.
        On the last stage the outputs concatenated (and the losses, given a target), else None."""
        with torch.no_grad():
            return self._run(args, target, losses, train=False)

    def _run(self, args: tuple[Any, ...], target: Any, losses: list[torch.Tensor] | None, train: bool) -> Any:
        stage, micro, step = self.stage, self.micro, self.steps
        if stage.is_first and not args:
            raise SluiceError(f"{stage.describe()} is the first stage: call step(inputs)")
        if stage.is_last and train and target is None:
            raise SluiceError(f"{stage.describe()} is the last stage: call step(target=...)")
        inputs = list(zip(*(_chunks(a, micro, "an input") for a in args), strict=True)) if stage.is_first else []
        targets = _chunks(target, micro, "the target") if stage.is_last and target is not None else []
        early = self.early if train else None
        split = early is not None and early.split_next()
        started = time.perf_counter()
        stage.begin(step, micro)
        outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        micro_losses: dict[int, torch.Tensor] = {}
        order = self.order if train else [("F", m, c) for c in range(stage.virtual) for m in range(micro)]
        final = stage.virtual - 1
        for index, (kind, m, chunk) in enumerate(order):
            if kind == "F":
                out = stage.forward_one(step, m, inputs[m] if inputs and chunk == 0 else (), keep=train,
                                        chunk=chunk)
                if stage.is_last and chunk == final:
                    outputs[m] = out
                    if targets:
                        assert self.loss_fn is not None
                        micro_losses[m] = self.loss_fn(out[0] if len(out) == 1 else out, targets[m])
                continue
            if self.replicas is not None and index == len(order) - 1:
                self.replicas.arm()  # the last backward: its gradients are final
            if kind == "W":
                stage.backward_weight(m, chunk)
                continue
            loss = micro_losses.get(m) if chunk == final else None
            if loss is not None and self.scale_grads:
                loss = loss / micro
            if kind == "I":
                stage.backward_input(step, m, loss, chunk)
            else:
                stage.backward_one(step, m, loss, chunk, split)
        if not train:
            stage.settle_forward_only(step)
        elif self.replicas is not None:
            self.replicas.finish()
        stage.end()
        self.steps += 1
        if early is not None and stage.unsplittable:
            early.forced = False
        if early is not None and (chosen := early.record(split, time.perf_counter() - started)) is not None:
            log.info("%s %s: steps of %.2f ms split against %.2f ms whole (medians of %d and %d trial steps)",
                     stage.describe(), "sends each inputs' gradient before computing the weights'" if chosen else
                     "runs its backwards whole", statistics.median(early.split) * 1e3,
                     statistics.median(early.whole) * 1e3, len(early.split), len(early.whole))
        if not stage.is_last:
            return None
        if losses is not None and micro_losses:
            losses.extend(micro_losses[m].detach() for m in range(micro))
        merged = [torch.cat([outputs[m][i].detach() for m in range(micro)]) for i in range(len(outputs[0]))]
        return merged[0] if len(merged) == 1 else tuple(merged)


class ScheduleGPipe(PipelineSchedule):
    """Fill-drain: every micro-batch's forward, then every backward; a stage holds all M at once."""

    name = "gpipe"


class Schedule1F1B(PipelineSchedule):
    """One forward, one backward (PipeDream-flush): stage s holds at most P - s micro-batches at once."""

    name = "1f1b"


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Megatron's interleaved 1F1B over the stage's V chunks (a list of modules): the fill and drain take a
    V-th of 1F1B's; M must be a multiple of max(1, M // P)."""

    name = "interleaved1f1b"


class ScheduleInterleavedZeroBubble(PipelineSchedule):
    """The backward split into I (inputs' gradient, sent at once) and W (weights', deferred into the
    bubbles): ZB-H1 with one chunk per stage, torch's interleaved zero bubble with V; no offload."""

    name = "interleavedzerobubble"


SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {
    kind.name: kind for kind in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)}


def get_schedule_class(name: str) -> type[PipelineSchedule]:
    """The schedule class a name stands for: ours ("1f1b", "interleaved1f1b", ...) or torch's ("1F1B",
    "Interleaved1F1B", "ScheduleInterleavedZeroBubble", ...), in any case (as torch's get_schedule_class)."""
    return SCHEDULE_CLASSES[canonical(name)]
