"""Horovod's elastic API for PyTorch (`hvd.elastic`): the framework-free State (worker/elastic/) with torch's parts.

`sluice launch --elastic` runs the job in generations of new processes; `state.commit()` writes the
state to a file on this host and `@hvd.elastic.run` restores the newest commit of the whole job
before calling the training function, then turns a Sluice failure or a hosts update into exit
status REFORM (worker/elastic/state.py says how). Here: TorchState (a model, an optimizer,
ElasticSamplers and plain attributes, committed by their state_dict with torch.save), and what the
State needs of sluice.torch (its rank, broadcast_object and allgather_object, its exit). Committed
state lives on the workers, so the optimizer must run there (worker.optimizer_on = "worker", the
default, or -s 0); "server" is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch

from sluice.errors import SluiceError
from sluice.worker.elastic import host
from sluice.worker.elastic import state as shared
from sluice.worker.elastic.host import Commit, HostsUpdatedInterrupt, watch_host_updates
from sluice.worker.torch.collectives import broadcast_parameters
from sluice.worker.torch.elastic_host import ENV_DIR, ENV_GENERATION, FILES, REFORM, reform
from sluice.worker.torch.elastic_sampler import ElasticSampler
from sluice.worker.torch.objects import allgather_object, broadcast_object, broadcast_optimizer_state
from sluice.worker.torch.rebind import rebind_all
from sluice.worker.torch.state import PENDING, STATE, require
from sluice.worker.torch.updates import READY, synchronize_parameters

__all__ = ["ENV_DIR", "ENV_GENERATION", "REFORM", "ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]


class _Torch(shared.Backend):
    files = FILES
    plain = (torch.Tensor,)

    def initialized(self) -> bool:
        return STATE.node is not None

    def rank(self) -> int:
        return require().rank

    def optimizer_on(self) -> str:
        return STATE.settings.optimizer_on

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return allgather_object(obj, name)

    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any:
        return broadcast_object(obj, root_rank, name)

    def reform(self, reason: BaseException, commits: int) -> NoReturn:
        reform(reason, commits)

    def reinit(self, reason: BaseException, commits: int) -> bool:
        from sluice.worker.torch.api import init, reinit_in_place  # api imports this module

        PENDING.clear()  # the committed state is what counts: what was in flight is redone
        READY.clear()
        host.reform_in_place(reason, commits, reinit_in_place, init)
        rebind_all()
        return True


host.fail_on_reform(lambda: STATE.node)  # what SIGUSR2 fails (--in-place): this process's connection then


TORCH = _Torch()


def _refuse_server_optimizer() -> None:
    shared.refuse_server_optimizer(STATE.settings.optimizer_on)


class State(shared.State):
    """What Horovod's State offers: reset callbacks, commit, check_host_updates, save, restore (the newest
    commit of the whole job), sync."""

    framework = TORCH


class ObjectState(shared.ObjectState, State):
    """Plain attributes (ints, floats, strs, tensors, lists and dicts of them), given as keyword arguments."""


_Stateful = torch.nn.Module | torch.optim.Optimizer | ElasticSampler


class TorchState(ObjectState):
    """A model, an optimizer, ElasticSamplers and plain attributes (batch, epoch, ...) as one state.
    Each of them is an attribute (`state.model`, `state.epoch`); the modules, optimizers and samplers
    are committed by their state_dict."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        objects: dict[str, Any] = {"model": model, "optimizer": optimizer}
        objects.update({k: v for k, v in kwargs.items() if isinstance(v, _Stateful)})
        self._object_names = [name for name, value in objects.items() if value is not None]
        super().__init__(**{k: v for k, v in kwargs.items() if k not in objects})
        for name, value in objects.items():
            setattr(self, name, value)

    def _objects(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._object_names}

    def _payload(self) -> dict[str, Any]:
        synchronize_parameters()  # updates still in flight land in the parameters first
        return {**super()._payload(), "objects": {name: obj.state_dict() for name, obj in self._objects().items()}}

    def _load(self, commit: Commit) -> None:
        saved = commit.payload.get("objects", {})
        missing = [name for name in self._object_names if name not in saved]
        if missing:
            raise SluiceError(f"the elastic commit {commit.path} has no {', '.join(missing)}: the script's TorchState "
                              "changed since it was committed; start the job afresh (without that directory)")
        for name, obj in self._objects().items():
            obj.load_state_dict(saved[name])
        super()._load(commit)

    def sync(self, root_rank: int = 0) -> None:
        synchronize_parameters()
        for name, obj in self._objects().items():
            if isinstance(obj, torch.nn.Module):
                broadcast_parameters([(f"elastic.{name}.{k}", t) for k, t in obj.state_dict().items()], root_rank)
            elif isinstance(obj, torch.optim.Optimizer):
                broadcast_optimizer_state(obj, root_rank)
            else:
                obj.load_state_dict(broadcast_object(obj.state_dict(), root_rank, f"elastic.{name}"))
        super().sync(root_rank)


F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Horovod's decorator for the training function `func(state, ...)` (worker/elastic/state.py's run):
    in an elastic job, the job's newest commit first (and the reset callbacks in a re-formed job), and a
    Sluice failure or HostsUpdatedInterrupt ends the process with status REFORM; outside one, rank 0's
    state first."""
    return shared.run(func, TORCH)


watch_host_updates()
