"""Sluice as a Lightning strategy: `Trainer(strategy=SluiceStrategy())` in a script run by `sluice launch`.

It does what Lightning 1.x's HorovodStrategy did, on Sluice: one process per device, started by
`sluice launch` (not by Lightning), ranks from the job, parameters and optimizer state broadcast
from rank 0 at the start of fit, each optimizer wrapped in Sluice's DistributedOptimizer (through
the parameter servers, or by allreduce with -s 0), its gradients averaged after every backward pass
(so gradient clipping and `on_before_optimizer_step` see averaged gradients, as under DDP), and
Lightning's collectives (`self.log(..., sync_dist=True)`, `all_gather`, barriers) on Sluice's.
Unlike HorovodStrategy it leaves the learning rate alone: gradients are averaged, as DDP's are, so a
script moved from DDP trains the same.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor

import sluice.torch as hvd
from sluice.errors import SluiceError


class SluiceEnvironment(ClusterEnvironment):
    """The job's ranks as Sluice knows them: `sluice launch` started the processes."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:  # torch.distributed's rendezvous, which `sluice launch` sets for DDP scripts
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return "SLUICE_SCHEDULER" in os.environ

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        if size != hvd.size():
            raise SluiceError(f"Lightning asked for {size} processes but the Sluice job has {hvd.size()} workers: "
                              "choose the worker count with `sluice launch -w N` and give Trainer devices=1")

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        return None  # Sluice's rank is the job's

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


class SluiceStrategy(ParallelStrategy):
    """Data-parallel training over Sluice; `optimizer_options` go to each DistributedOptimizer
    (e.g. compression=hvd.Compression.fp16, groups=4)."""

    strategy_name = "sluice"

    def __init__(self, accelerator: pl.accelerators.Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, **optimizer_options: Any) -> None:
        hvd.init()  # here, so that only rank 0 logs from the Trainer's construction on
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=SluiceEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        _log_on_rank_zero()
        self.optimizer_options = optimizer_options
        self._failed = False

    @property
    def is_distributed(self) -> bool:  # Lightning adds a DistributedSampler for strategies that say so
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device: torch.device = self.parallel_devices[0]
        if device.type == "cuda":  # one process per GPU, as under horovodrun: this host's local rank picks it
            return torch.device("cuda", hvd.local_rank() % max(torch.cuda.device_count(), 1))
        return device

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def setup_environment(self) -> None:
        _log_on_rank_zero()
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.lightning_module is not None
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        for optimizer in optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        named = list(self.lightning_module.named_parameters())
        # a DistributedOptimizer shares the optimizer's parameter groups, so LR schedulers made for it still apply
        self.optimizers = [_closure_first(hvd.DistributedOptimizer(
            optimizer, named_parameters=_named_in(named, optimizer), **self.optimizer_options))
            for optimizer in optimizers]

    def post_backward(self, closure_loss: Tensor) -> None:
        # averaged now, before clipping and the step; a backward pass that accumulates (accumulate_grad_batches)
        # is averaged too, which keeps the sum of the passes the average of every rank's
        for optimizer in self.optimizers:
            synchronize = getattr(optimizer, "synchronize", None)
            if synchronize is not None:
                synchronize()

    def barrier(self, name: str | None = None) -> None:
        hvd.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        result: TBroadcast = hvd.broadcast_object(obj, root_rank=src)
        return result

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce: the mean (or the sum) over every rank; what is no tensor comes back as it is."""
        if group is not None:
            raise SluiceError("SluiceStrategy reduces over the whole job: leave `group` unset")
        if not isinstance(tensor, Tensor):
            return tensor
        # a string ("mean", "avg", "sum") or torch's ReduceOp (whose members have a name: SUM, AVG)
        op = (reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", "") or "mean").lower()
        if op not in ("mean", "avg", "sum"):
            raise SluiceError(f"SluiceStrategy.reduce: unsupported reduce_op {reduce_op!r}; use 'mean' or 'sum'")
        return hvd.allreduce(tensor, op=hvd.Sum if op == "sum" else hvd.Average)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every rank's `tensor`, stacked along a new first dimension (as under DDP)."""
        if group is not None:
            raise SluiceError("SluiceStrategy gathers over the whole job: leave `group` unset")
        gathered: Tensor = hvd.allgather(tensor.unsqueeze(0))
        return gathered if sync_grads else gathered.detach()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True

    def teardown(self) -> None:
        if not self._failed:  # every rank finishes before any returns to the user, as HorovodStrategy did;
            # a rank that failed must not wait for the others: its exit tells them it is gone
            with contextlib.suppress(SluiceError):
                hvd.join()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Sluice: parameter servers or allreduce")


def _log_on_rank_zero() -> None:
    """Lightning's rank_zero_only (its logs, progress bar, warnings) then acts on this job's rank 0 alone."""
    rank_zero_only.rank = hvd.rank()  # type: ignore[attr-defined]  # the attribute Lightning reads


def _closure_first(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` whose step(closure) runs the closure (Lightning's forward and backward pass) before it steps.

    A DistributedOptimizer's step(closure), as Horovod's, first reduces what the backward pass left
    (zeros, before the closure ran: a wasted round) and only then runs the closure; Lightning always
    passes one, so this runs it first, and the step then finds the gradients averaged (post_backward).
    """
    step = optimizer.step

    def step_after_closure(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        step(**kwargs)
        return loss

    optimizer.step = step_after_closure  # type: ignore[method-assign]  # this one optimizer, not its class
    return optimizer


def _named_in(named: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
              ) -> list[tuple[str, torch.nn.Parameter]]:
    """The module's named parameters that `optimizer` steps (a module may have several optimizers)."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [(name, p) for name, p in named if id(p) in mine]
