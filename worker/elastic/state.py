"""Horovod's elastic State for a launcher that re-forms the job in generations of new processes, framework-free.

`sluice launch --elastic` runs the job in generations: when a worker dies or asks for it (exit status
REFORM), every process of the generation is stopped and a new one starts with fresh ranks 0..W'-1,
running the script from the top. So `state.commit()` writes the state to a file on this host
(host.py), and `run` restores the newest commit of the whole job before calling the training
function, then turns a Sluice failure (a lost peer, a failed round) or a hosts update (SIGUSR1 from
the launcher) into exit status REFORM. What ran after the last commit is lost and runs again.
Committed state lives on the workers, so the optimizer must run there (worker.optimizer_on =
"worker"); "server" is refused.

Without SLUICE_ELASTIC_DIR (plain `sluice launch`) `run` gives every worker rank 0's state and calls
the function, and `commit()` writes nothing: the same script runs either way. What a framework adds
(its rank, object collectives, commit file format, which exceptions re-form the job, how Sluice
closes) is its `Backend`: worker/torch/elastic.py's, worker/tensorflow/elastic.py's.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn, TypeVar

from sluice.errors import SluiceError
from sluice.worker.collective import process_set
from sluice.worker.elastic.host import (
    NO_COMMIT,
    Commit,
    CommitFiles,
    HostsUpdatedInterrupt,
    elastic_env,
    hosts_updated,
    in_place,
    watch_host_updates,
)

log = logging.getLogger("sluice.worker")


class Backend(ABC):
    """What a framework's shim gives the elastic State."""

    #: the commit files, in the shim's format
    files: CommitFiles
    #: the attribute values ObjectState commits besides None, bool, int, float and str, and their name
    plain: tuple[type, ...] = ()
    plain_what: str = "tensors"

    @abstractmethod
    def initialized(self) -> bool:
        """Has hvd.init() run (and no shutdown since)?"""

    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def optimizer_on(self) -> str:
        """worker.optimizer_on: "worker" or "server"."""

    @abstractmethod
    def allgather_object(self, obj: Any, name: str) -> list[Any]: ...

    @abstractmethod
    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any: ...

    def failed(self, exc: BaseException) -> bool:
        """Does `exc` (raised by the training function) re-form the job? A Sluice failure or a hosts update."""
        return isinstance(exc, SluiceError | HostsUpdatedInterrupt)

    @abstractmethod
    def reform(self, reason: BaseException, commits: int) -> NoReturn:
        """Drop what is in flight and leave with status REFORM (host.reform)."""

    def reinit(self, reason: BaseException, commits: int) -> bool:
        """Drop what is in flight and join the job again in this process once the launcher re-formed it
        (--in-place, host.reform_in_place); False: this shim cannot, and the process leaves (reform)."""
        return False


def refuse_server_optimizer(optimizer_on: str) -> None:
    if optimizer_on == "server":
        raise SluiceError("elastic training keeps the committed state on the workers, but with worker.optimizer_on "
                          "= 'server' the parameters and optimizer state live on the servers: set "
                          "worker.optimizer_on = 'worker' (the default), or run allreduce only with -s 0")


def check_plain(name: str, value: Any, backend: Backend) -> None:
    """Attributes travel in the commit file and by broadcast_object (msgpack): plain values only."""
    if isinstance(value, list | tuple):
        for item in value:
            check_plain(name, item, backend)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_plain(name, key, backend)
            check_plain(name, item, backend)
    elif not isinstance(value, (type(None), bool, int, float, str, *backend.plain)):
        raise TypeError(f"elastic state attribute {name!r} holds a {type(value).__name__}: only None, bool, int, "
                        f"float, str, {backend.plain_what}, and lists, tuples and dicts of them can be committed")


class State:
    """What Horovod's State offers: reset callbacks, commit, check_host_updates, save, restore, sync."""

    #: the framework shim's parts
    framework: ClassVar[Backend]

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        #: commits of the whole job so far (the same on every worker; resume() takes the job's)
        self.commits = 0
        self._cleaned = False  # this process removed the host's older commit files
        self._restored = False  # run() restored this state in this process
        watch_host_updates()

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Call these after a re-formed job restored the state (e.g. to scale the learning rate by size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a re-formed job restored the state: `reset()`, then the reset callbacks, as Horovod's State."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Override to rebuild what depends on the job's size (a sampler, a learning rate) after a re-forming;
        Horovod's State.reset, called by on_reset before the callbacks."""

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
        refuse_server_optimizer(self.framework.optimizer_on())
        rank = self.framework.rank()
        key = (env.generation, self.commits)
        payload = {"format": 1, "generation": key[0], "commit": key[1], "rank": rank, **self._payload()}
        path = self.framework.files.write(env.directory, rank, payload)
        if not self._cleaned:
            self._cleaned = True
            self.framework.files.remove_older(env.directory, key, path)

    def restore(self) -> None:
        """The newest commit of the whole job, on every worker (resume)."""
        self.resume()

    def resume(self) -> None:
        """Load the newest commit of the whole job: each worker finds its host's newest file, the job
        agrees on the latest (the lowest rank holding it sends it) and every worker takes it, a worker
        with no file (a new host) included. Nothing committed anywhere: rank 0's state is sent."""
        env = elastic_env()
        found = self.framework.files.newest(env.directory) if env is not None else None
        keys = [tuple(k) for k in self.framework.allgather_object(list(found.key if found is not None else NO_COMMIT),
                                                                "elastic.keys")]
        latest = max(keys)
        root = keys.index(latest)  # the lowest rank holding the latest commit
        rank = self.framework.rank()
        if latest != NO_COMMIT and rank == root:
            assert found is not None  # the rank holding the latest key found a file
            self._load(found)
        self.commits = max(int(latest[1]), 0)
        self.sync(root)
        if latest == NO_COMMIT:
            log.info("elastic: nothing committed yet: worker %d starts from rank 0's state", rank)
        else:
            log.info("elastic: worker %d restored commit %d of generation %d (sent by rank %d)", rank,
                     self.commits, latest[0], root)

    def sync(self, root_rank: int = 0) -> None:
        """Give every worker `root_rank`'s state."""
        raise NotImplementedError

    def _payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, commit: Commit) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes (ints, floats, strs, the framework's tensors, lists and dicts of them), given as keyword
    arguments."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._attribute_names = list(kwargs)
        for name, value in kwargs.items():
            check_plain(name, value, self.framework)
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """Reached only for a name that was never set: the keyword arguments are plain attributes, and
        this tells type checkers so."""
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _attributes(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self._attribute_names}
        for name, value in values.items():
            check_plain(name, value, self.framework)
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
            for name, value in self.framework.broadcast_object(self._attributes(), root_rank,
                                                             "elastic.attributes").items():
                setattr(self, name, value)


F = TypeVar("F", bound=Callable[..., Any])


def run(func: F, backend: Backend) -> F:
    """Horovod's decorator for the training function `func(state, ...)`. In an elastic job, its first
    call in this process restores the job's newest commit (State.resume) and, in a re-formed job
    (generation > 0), calls the reset callbacks; then runs `func`. A Sluice failure (backend.failed:
    a lost peer, a failed round) or HostsUpdatedInterrupt ends the process with status REFORM, after
    closing Sluice within a few seconds: the launcher starts the next generation from the last commit.
    With --in-place a failure instead re-forms the job in this process (Backend.reinit): Horovod's
    elastic loop, restore the newest commit, reset callbacks, call `func` again.
    Any other exception ends the job as a failure. Outside an elastic job it gives every worker rank
    0's state (State.sync, once; not before hvd.init()) and calls `func`."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        env = elastic_env()
        if env is None:  # plain sluice launch: a failure ends the job; rank 0's state first, as in Horovod
            if backend.initialized() and not state._restored:
                state.sync()
                state._restored = True
            return func(state, *args, **kwargs)
        if not backend.initialized():
            raise SluiceError("call init() first")
        refuse_server_optimizer(backend.optimizer_on())  # a setting, not a failure: re-forming would not help
        watch_host_updates()
        while True:
            try:
                if not state._restored:
                    state.resume()
                    state._restored = True
                    if (elastic_env() or env).generation > 0:
                        state.on_reset()
                with process_set.in_elastic_run():
                    return func(state, *args, **kwargs)
            except BaseException as exc:
                if not backend.failed(exc):
                    raise
                # a lost worker (--in-place): this process re-forms the job with its replacement; new
                # hosts, or a shim that cannot: the launcher starts a new generation of processes
                if isinstance(exc, HostsUpdatedInterrupt) or not in_place() or not backend.reinit(exc, state.commits):
                    backend.reform(exc, state.commits)
                state._restored = False

    return wrapper  # type: ignore[return-value]
