"""Horovod's elastic API (`hvd.elastic`) for a launcher that re-forms the job in generations of new processes.

`sluice launch --elastic` runs the job in generations: when a worker dies or asks for it (exit status
REFORM), every process of the generation is stopped and a new one starts with fresh ranks 0..W'-1,
running the script from the top. So `state.commit()` writes the state to a file on this host
(elastic_host.py), and `@hvd.elastic.run` restores the newest commit of the whole job before
calling the training function, then turns a Sluice failure (a lost peer, a failed round) or a
hosts update (SIGUSR1 from the launcher) into exit status REFORM. What ran after the last commit is
lost and runs again. Committed state lives on the workers, so the optimizer must run there
(worker.optimizer_on = "worker", the default, or -s 0); "server" is refused.

Without SLUICE_ELASTIC_DIR (plain `sluice launch`) `run` gives every worker rank 0's state and calls
the function, and `commit()` writes nothing: the same script runs either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from sluice.errors import SluiceError
from sluice.worker.torch.collectives import broadcast_parameters
from sluice.worker.torch.elastic_host import (
    ENV_DIR,
    ENV_GENERATION,
    NO_COMMIT,
    REFORM,
    Commit,
    HostsUpdatedInterrupt,
    elastic_env,
    hosts_updated,
    newest_commit,
    reform,
    remove_older,
    watch_host_updates,
    write_commit,
)
from sluice.worker.torch.elastic_sampler import ElasticSampler
from sluice.worker.torch.objects import allgather_object, broadcast_object, broadcast_optimizer_state
from sluice.worker.torch.optimizer import synchronize_parameters
from sluice.worker.torch.state import STATE, log, require

__all__ = ["ENV_DIR", "ENV_GENERATION", "REFORM", "ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]

_PLAIN_LEAVES = (type(None), bool, int, float, str, torch.Tensor)


def _refuse_server_optimizer() -> None:
    if STATE.settings.optimizer_on == "server":
        raise SluiceError("elastic training keeps the committed state on the workers, but with worker.optimizer_on "
                          "= 'server' the parameters and optimizer state live on the servers: set "
                          "worker.optimizer_on = 'worker' (the default), or run allreduce only with -s 0")


def _check_plain(name: str, value: Any) -> None:
    """Attributes travel by torch.save (loaded weights_only) and broadcast_object (msgpack): plain values only."""
    if isinstance(value, list | tuple):
        for item in value:
            _check_plain(name, item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_plain(name, key)
            _check_plain(name, item)
    elif not isinstance(value, _PLAIN_LEAVES):
        raise TypeError(f"elastic state attribute {name!r} holds a {type(value).__name__}: only None, bool, int, "
                        "float, str, tensors, and lists, tuples and dicts of them can be committed")


class State:
    """What Horovod's State offers: reset callbacks, commit, check_host_updates, save, restore, sync."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        #: commits of the whole job so far (the same on every worker; restore() takes the job's)
        self.commits = 0
        self._cleaned = False  # this process removed the host's older commit files
        self._restored = False  # run() restored this state in this process
        watch_host_updates()

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Call these after a re-formed job restored the state (e.g. to scale the learning rate by size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state as the job's newest (to this host's elastic directory; nothing outside an
        elastic job), then raise HostsUpdatedInterrupt if the launcher found more slots. Commits
        cost a copy of the state to /dev/shm: commit every few steps, not necessarily every one."""
        self.commits += 1
        try:
            self.save()
        except BaseException:
            self.commits -= 1  # not committed: a re-formed job starts from the one before
            raise
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt if SIGUSR1 came since the last check. Each worker checks its
        own signal (no collective): one that leaves makes the others' next step fail, and the
        launcher stops them; every worker has committed the same state by then."""
        if hosts_updated():
            raise HostsUpdatedInterrupt("SIGUSR1 came: the launcher found more slots")

    def save(self) -> None:
        env = elastic_env()
        if env is None:
            return
        _refuse_server_optimizer()
        rank = require().rank
        key = (env.generation, self.commits)
        payload = {"format": 1, "generation": key[0], "commit": key[1], "rank": rank, **self._payload()}
        path = write_commit(env.directory, rank, payload)
        if not self._cleaned:
            self._cleaned = True
            remove_older(env.directory, key, path)

    def restore(self) -> None:
        """Load the newest commit of the whole job: each worker finds its host's newest file, the job
        agrees on the latest (the lowest rank holding it sends it) and every worker takes it, a worker
        with no file (a new host) included. Nothing committed anywhere: rank 0's state is sent."""
        env = elastic_env()
        found = newest_commit(env.directory) if env is not None else None
        keys = [tuple(k) for k in allgather_object(list(found.key if found is not None else NO_COMMIT),
                                                   "elastic.keys")]
        latest = max(keys)
        root = keys.index(latest)  # the lowest rank holding the latest commit
        if latest != NO_COMMIT and require().rank == root:
            assert found is not None  # the rank holding the latest key found a file
            self._load(found)
        self.commits = max(int(latest[1]), 0)
        self.sync(root)
        if latest == NO_COMMIT:
            log.info("elastic: nothing committed yet: worker %d starts from rank 0's state", require().rank)
        else:
            log.info("elastic: worker %d restored commit %d of generation %d (sent by rank %d)", require().rank,
                     self.commits, latest[0], root)

    def sync(self, root_rank: int = 0) -> None:
        """Give every worker `root_rank`'s state."""
        raise NotImplementedError

    def _payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, commit: Commit) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes (ints, floats, strs, tensors, lists and dicts of them), given as keyword arguments."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._attribute_names = list(kwargs)
        for name, value in kwargs.items():
            _check_plain(name, value)
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """Reached only for a name that was never set: the keyword arguments are plain attributes, and
        this tells type checkers so."""
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _attributes(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self._attribute_names}
        for name, value in values.items():
            _check_plain(name, value)
        return values

    def _payload(self) -> dict[str, Any]:
        return {"attributes": self._attributes()}

    def _load(self, commit: Commit) -> None:
        attributes = commit.payload.get("attributes", {})
        for name in self._attribute_names:
            if name in attributes:
                setattr(self, name, attributes[name])

    def sync(self, root_rank: int = 0) -> None:
        if self._attribute_names:
            for name, value in broadcast_object(self._attributes(), root_rank, "elastic.attributes").items():
                setattr(self, name, value)


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
    """Horovod's decorator for the training function `func(state, ...)`. In an elastic job, its first
    call in this process restores the job's newest commit (State.restore) and, in a re-formed job
    (generation > 0), calls the reset callbacks; then runs `func`. A Sluice failure (SluiceError: a
    lost peer, a failed round) or HostsUpdatedInterrupt ends the process with status REFORM, after
    closing Sluice within a few seconds: the launcher starts the next generation from the last commit.
    Any other exception ends the job as a failure. Outside an elastic job it gives every worker rank
    0's state (State.sync, once; not before hvd.init()) and calls `func`."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        env = elastic_env()
        if env is None:  # plain sluice launch: a failure ends the job; rank 0's state first, as in Horovod
            if STATE.node is not None and not state._restored:
                state.sync()
                state._restored = True
            return func(state, *args, **kwargs)
        require()
        _refuse_server_optimizer()  # a setting, not a failure: re-forming would not help
        watch_host_updates()
        try:
            if not state._restored:
                state.restore()
                state._restored = True
                if env.generation > 0:
                    state.on_reset()
            return func(state, *args, **kwargs)
        except (SluiceError, HostsUpdatedInterrupt) as exc:
            reform(exc, state.commits)

    return wrapper  # type: ignore[return-value]


watch_host_updates()
