"""One pipeline stage of a torch model on this worker: its module or chunks, its neighbours, a micro-batch's passes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from sluice.errors import SluiceError
from sluice.worker.pipeline.exchange import Neighbours, StageExchange
from sluice.worker.pipeline.frames import BACKWARD, FORWARD, Received
from sluice.worker.pipeline.layout import StagePlace
from sluice.worker.pipeline.ring import RingExchange, RingPlace
from sluice.worker.staging import DTYPES, tensor_of, wire_array, wire_dtype
from sluice.worker.torch.offload import OffloadStats, offloaded
from sluice.worker.torch.pipelining.backward import WeightGrads, backward_input
from sluice.worker.torch.state import require

log = logging.getLogger("sluice.worker")
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
#: gradients go backward more urgently than activations go forward: a backward frees memory and, in
#: 1F1B, the stage before waits on it; the replicas' gradient averaging comes last
GRADIENT_PRIORITY, ACTIVATION_PRIORITY, REPLICA_PRIORITY = 0, 1, 2
#: what an eval step's acknowledgement and a closing stage's last word carry: nothing
_EMPTY = [(np.zeros(0, np.float32), "float32")]
#: how long a closing stage may take to hand its direct lanes what still waits for room in them
CLOSE_FLUSH_S = 5.0


@dataclass
class _Held:
    """What a micro-batch's forward left for its backward: its inputs and outputs (or loss)."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _wire(tensor: torch.Tensor) -> tuple[Any, str]:
    """`tensor`'s wire storage on the host and its dtype's name. As few torch calls as can be: each is the
    first thing a stage does after a slot's compute, when it costs 20-28 times what it does warm
    (bench/cold_path.py)."""
    host = tensor.detach()
    if not host.is_cpu:
        host = host.to("cpu")
    if not host.is_contiguous():
        host = host.contiguous()
    return wire_array(host), wire_dtype(host)


class PipelineStage:
    """Stage `stage_index` of `num_stages` (torch.distributed.pipelining's PipelineStage): `submodule` runs
    on this worker, between the stage before it and the stage after it in its pipeline replica. A list
    of V modules makes V chunks for the interleaved schedules: chunk c is virtual stage c * num_stages +
    stage_index of V * num_stages, and the stages form a ring (the last one's chunk c feeds the first
    one's chunk c + 1); `submod` is then an nn.ModuleList of them (for the optimizer).

    Workers map to stages as stage = rank % num_stages, replica = rank // num_stages (see
    sluice.worker.pipeline.layout); `stage_index` may be left out, and must match when given. With more
    workers than stages, each stage's replicas average its gradients at the end of every step.
    `compress`: ZVC for the messages ("auto": towards a neighbour on another host). `offload`: the
    activations each forward saves for its backward go to host memory (compressed on a CPU) until then,
    those of at least `offload_min_bytes`, and ReLUs and max-pools keep a bitmask and window offsets
    instead unless `offload_lean` is False; `offload_compress` ZVC-encodes the rest too (by default on a
    CPU only without lean saves: sluice.worker.torch.offload, sluice.worker.torch.lean).
    `timeout`: how long a receive waits (default: scheduler.op_timeout). `direct`: messages to a neighbour
    on this host go over a direct lane, written and read by the stages' own threads (transport/lane.py).
    """

    def __init__(self, submodule: nn.Module | Sequence[nn.Module], stage_index: int | None, num_stages: int,
                 device: torch.device | str | None = None, *, compress: str = "auto", offload: bool = False,
                 offload_min_bytes: int = 1 << 16, offload_lean: bool = True, offload_compress: bool | None = None,
                 timeout: float | None = None, direct: bool = True) -> None:
        node = require()
        given: list[Any] = list(submodule) if isinstance(submodule, (list, tuple, nn.ModuleList)) else [submodule]
        if not given or not all(isinstance(c, nn.Module) for c in given):
            raise SluiceError("a pipeline stage runs an nn.Module, or a list of them (its chunks)")
        chunks: list[nn.Module] = given
        if len(chunks) > 1 and num_stages < 2:
            raise SluiceError(f"{len(chunks)} chunks on one stage: interleaving needs at least two stages")
        ring = RingPlace(node.rank, node.size, num_stages) if len(chunks) > 1 else None
        self.place = ring or StagePlace(node.rank, node.size, num_stages)
        if stage_index is not None and stage_index != self.place.stage:
            raise SluiceError(f"worker {node.rank} runs stage {self.place.stage} of {num_stages} (stage = rank % "
                              f"stages), not stage {stage_index}: pass stage_index=None, or hvd.rank() % {num_stages}")
        #: the model chunks this worker runs (one but for interleaved schedules)
        self.chunks = chunks
        self.submod: nn.Module = chunks[0] if ring is None else nn.ModuleList(chunks)
        self.device = torch.device(device) if device is not None else next(
            (p.device for p in self.submod.parameters()), torch.device("cpu"))
        self._on_host = self.device.type == "cpu"
        self.offload, self.offload_min_bytes, self.offload_lean = offload, offload_min_bytes, offload_lean
        self.offload_compress = offload_compress
        workers = Neighbours(node.names("worker"), node.hosts("worker"))
        timeout = timeout or node.control_settings.op_timeout

        def channel(priority: int) -> int:
            return node.settings.channel_for(priority, REPLICA_PRIORITY + 1)

        options: dict[str, Any] = {"compress": compress, "chunk_bytes": node.settings.chunk_limit,
                                   "collective": node.collective_settings, "direct": direct}
        self.exchange = StageExchange(node.transport, self.place, workers, timeout, channel, **options) if (
            ring is None) else RingExchange(node.transport, ring, workers, timeout, channel, **options)
        node.attach_pipeline(self.exchange.on_message, self.exchange.fail)
        node.on_close(self.close)
        self._next_step = 0
        self._closed = False
        #: a step began and has not ended (it raised, or is still running)
        self._in_step = False
        self._held: dict[tuple[int, int], _Held] = {}  # by (chunk, micro-batch)
        #: the weights' half of the backwards whose inputs' half ran (split backward), by (chunk, micro-batch)
        self._weights: dict[tuple[int, int], WeightGrads] = {}
        self._micro = 1
        #: the most micro-batches whose activations this stage held at once, in the last step
        self.peak_held = 0
        #: offloaded bytes (raw and stored) of the last step, with `offload`
        self.offload_stats: list[OffloadStats] = []
        #: a split backward failed here (autograd refused it: reentrant checkpointing): whole from then on
        self.unsplittable = False

    # ------------------------------------------------------------------ who is where
    @property
    def stage_index(self) -> int:
        return self.place.stage

    @property
    def num_stages(self) -> int:
        return self.place.stages

    @property
    def is_first(self) -> bool:
        return self.place.first

    @property
    def is_last(self) -> bool:
        return self.place.last

    @property
    def virtual(self) -> int:
        """V, the chunks of the model this stage runs."""
        return len(self.chunks)

    def describe(self, chunk: int | None = None) -> str:
        here = self.exchange.workers.describe(self.place, self.place.rank)
        return here if chunk is None or self.virtual == 1 else (
            f"{here}, chunk {chunk} (virtual stage {chunk * self.num_stages + self.stage_index})")

    def _wire(self, micro: int, chunk: int, before: bool) -> int:
        """The number a message of `micro` carries between virtual stage (chunk, this stage) and the one
        `before` it (else after it): chunk * M + micro, the chunk being the earlier virtual stage's."""
        earlier = chunk - 1 if before and self.stage_index == 0 else chunk
        return earlier * self._micro + micro

    # ------------------------------------------------------------------ one micro-batch
    def forward_one(self, step: int, micro: int, args: tuple[Any, ...], keep: bool = True,
                    chunk: int = 0) -> tuple[torch.Tensor, ...]:
        """Run the forward of `micro` through `chunk`: on `args` on the first (virtual) stage, else on what
        the stage before sent; send the outputs on (but from the last), and `keep` what the backward
        needs. The outputs."""
        if self.is_first and chunk == 0:
            inputs = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        else:
            inputs = tuple(self._tensor(r, keep)
                           for r in self.exchange.receive(FORWARD, step, self._wire(micro, chunk, True)))
        module = self.chunks[chunk]
        try:
            if self.offload and keep:
                with offloaded(self.offload_compress, self.offload_min_bytes, lean=self.offload_lean) as stats:
                    outputs = _as_tuple(module(*inputs))
                self.offload_stats.append(stats)
            else:
                outputs = _as_tuple(module(*inputs))
        except Exception as exc:
            shapes = ", ".join(f"{list(x.shape)} {x.dtype}" for x in inputs if isinstance(x, torch.Tensor))
            raise SluiceError(f"{self.describe(chunk)}: its module failed on micro-batch {micro} of step {step}, "
                              f"whose inputs were {shapes}: {type(exc).__name__}: {exc}") from exc
        if not self._last(chunk):
            self.exchange.send(FORWARD, step, self._wire(micro, chunk, False), [_wire(o) for o in outputs],
                               ACTIVATION_PRIORITY)
        if keep:
            self._held[(chunk, micro)] = _Held(inputs, outputs)
            self.peak_held = max(self.peak_held, len(self._held))
        return outputs

    def _last(self, chunk: int) -> bool:
        return self.is_last and chunk == self.virtual - 1

    def backward_one(self, step: int, micro: int, loss: torch.Tensor | None = None, chunk: int = 0,
                     split: bool = False) -> None:
        """Run the backward of `micro` through `chunk`: from `loss` on the last (virtual) stage, else from
        the gradients the stage after sent; send the inputs' gradients back (but from the first); drop
        what was held. `split`: the inputs' gradients first, sent before the weights' are computed
        (whole where that would run the input path twice: backward.backward_input; and on the first
        virtual stage, whose inputs' gradient nobody waits for)."""
        held = self._held.pop((chunk, micro))
        pairs = self._seeds(step, micro, chunk, held, loss)
        floats = [x for x in held.inputs if x.is_floating_point()]
        weights = None
        if split and pairs and not self.unsplittable and not (self.is_first and chunk == 0):
            try:
                grads, weights = backward_input([o for o, _ in pairs], [g for _, g in pairs], floats,
                                                whole_if_inexact=True)
            except RuntimeError as exc:  # reentrant checkpointing refuses .grad(); the graph is left whole
                self.unsplittable = True
                log.warning("%s: its backward cannot be split (%s); it runs whole", self.describe(chunk), exc)
        if weights is None:
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = [x.grad for x in floats]
        self._send_back(step, micro, chunk, grads, floats)
        if weights is not None:
            weights.run()

    def backward_input(self, step: int, micro: int, loss: torch.Tensor | None = None, chunk: int = 0) -> None:
        """The first half of a split backward (I): the inputs' gradients of `micro` through `chunk`, sent
        back at once; the weights' gradients wait for `backward_weight`, and so does what was held."""
        held = self._held[(chunk, micro)]
        pairs = self._seeds(step, micro, chunk, held, loss)
        floats = [x for x in held.inputs if x.is_floating_point()]
        try:
            grads, self._weights[(chunk, micro)] = backward_input([o for o, _ in pairs], [g for _, g in pairs],
                                                                  floats)
        except RuntimeError as exc:
            raise SluiceError(f"{self.describe(chunk)}: zero bubble splits each backward in two, which autograd "
                              f"refused here ({exc}). Checkpoint with use_reentrant=False, or take a schedule "
                              "whose backwards may run whole (Schedule1F1B, ScheduleInterleaved1F1B)") from exc
        self._send_back(step, micro, chunk, grads, floats)

    def backward_weight(self, micro: int, chunk: int = 0) -> None:
        """The second half of a split backward (W): the weights' gradients of `micro` through `chunk`
        accumulate into the parameters' `.grad`; what the micro-batch held is dropped."""
        self._weights.pop((chunk, micro)).run()
        del self._held[(chunk, micro)]

    def _seeds(self, step: int, micro: int, chunk: int, held: _Held,
               loss: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Where the backward of `micro` starts: the loss (last stage), else the outputs and their gradients."""
        if loss is not None:
            return [(loss, None)]
        return list(self._output_grads(step, micro, chunk, held))

    def _output_grads(self, step: int, micro: int, chunk: int, held: _Held) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradients the stage after sent for `micro`'s outputs, with the outputs that take them."""
        outputs = [o for o in held.outputs if o.is_floating_point()]
        grads = self.exchange.receive(BACKWARD, step, self._wire(micro, chunk, False))
        if len(grads) != len(outputs):
            raise SluiceError(f"{self.describe(chunk)} sent {len(outputs)} floating-point activations for "
                              f"micro-batch {micro} of step {step} and got {len(grads)} gradients back")
        pairs = []
        for index, (output, grad) in enumerate(zip(outputs, grads, strict=True)):
            tensor = self._tensor(grad, requires_grad=False)
            if tensor.shape != output.shape or tensor.dtype != output.dtype:
                raise SluiceError(
                    f"{self.describe(chunk)} got a gradient of {list(tensor.shape)} {tensor.dtype} for its output "
                    f"{index} of micro-batch {micro} of step {step}, which it sent as {list(output.shape)} "
                    f"{output.dtype}")
            if output.requires_grad:
                pairs.append((output, tensor))
        return pairs

    def _send_back(self, step: int, micro: int, chunk: int, grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor]) -> None:
        """The inputs' gradients (zeros where none came) to the stage before (none from the first)."""
        if not (self.is_first and chunk == 0):
            self.exchange.send(BACKWARD, step, self._wire(micro, chunk, True),
                               [_wire(g if g is not None else torch.zeros_like(x)) for g, x in zip(grads, inputs,
                                                                                                    strict=True)],
                               GRADIENT_PRIORITY)

    def end(self) -> None:
        """The step ended well (the schedule calls it last)."""
        self._in_step = False

    def settle_forward_only(self, step: int) -> None:
        """End a step of forwards alone (eval): each stage waits for the stage after it to be done, then
        says so to the one before (an empty gradient message). Without it the first stage, which waits
        for nothing in eval, could run any number of steps ahead of the others; with it, at most one,
        as in training, where the gradients bound it."""
        if not self.is_last:
            self.exchange.receive(BACKWARD, step, 0)
        if not self.is_first:
            self.exchange.send(BACKWARD, step, 0, _EMPTY, GRADIENT_PRIORITY)

    def close(self) -> None:
        """Leave only once the stage before has everything this one sent it: a process that exits right
        after queueing its last gradients would lose them on a slow link. Every stage runs one more,
        empty step: it sends an empty activation on, then waits for the one from the stage before, which
        that stage sends only when it has finished (consumed every gradient from here). The node calls
        it as it closes; a missing neighbour is logged after the deadline, not raised, at exit. After a step
        that failed here, it does not wait: the job is ending, and the stage before may wait on this one."""
        if self._closed:
            return
        self._closed = True
        for direction, compression in zip(("activations", "gradients"), self.exchange.compression.values(),
                                          strict=True):
            if compression.enabled and compression.sent_bytes:
                log.info("%s sent its %s ZVC-compressed at a ratio of %.2f (%.1f MiB raw, %.1f MiB sent)",
                         self.describe(), direction, compression.ratio, compression.raw_bytes / (1 << 20),
                         compression.sent_bytes / (1 << 20))
        if self._in_step:
            return
        step = self._next_step
        self.exchange.begin(step, 1)
        try:  # in a ring (interleaved), the first and the last stage exchange it too
            if self.place.next is not None:
                self.exchange.send(FORWARD, step, 0, _EMPTY, ACTIVATION_PRIORITY)
            if self.place.previous is not None:
                self.exchange.receive(FORWARD, step, 0)
        except SluiceError as exc:
            log.warning("%s: closing without the stage before's last word: %s", self.describe(), exc)
        finally:
            self.exchange.close(CLOSE_FLUSH_S)

    def begin(self, step: int, micro_batches: int) -> None:
        self._next_step = step + 1
        self._in_step = True
        self._held.clear()
        self._weights.clear()
        self._micro = micro_batches
        self.peak_held = 0
        self.offload_stats = []
        self.exchange.begin(step, micro_batches * self.virtual)

    def _tensor(self, received: Received, requires_grad: bool = True) -> torch.Tensor:
        dtype = TORCH_DTYPES[received.dtype]
        tensor = tensor_of(received.array, dtype)
        if not self._on_host:  # a CPU stage skips the call: see _wire
            tensor = tensor.to(self.device)
        if requires_grad and tensor.is_floating_point():
            tensor.requires_grad_(True)
        return tensor

    def compression_ratio(self) -> dict[str, float]:
        """Raw bytes over bytes sent, per direction, since the stage began (1.0: nothing compressed)."""
        return {"forward": self.exchange.compression[FORWARD].ratio,
                "backward": self.exchange.compression[BACKWARD].ratio}
