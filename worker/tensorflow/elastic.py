"""Horovod's horovod.tensorflow.elastic on Sluice: TensorFlowKerasState, TensorFlowState, ObjectState and run.

The State protocol is worker/elastic/state.py's, as for sluice.torch: under `sluice launch --elastic`
the job runs in generations of new processes, `state.commit()` writes the state to this host's
elastic directory and `@hvd.elastic.run` restores the newest commit of the whole job (`resume`)
before calling the training function, and leaves with status REFORM on a Sluice failure (also one
raised inside a tf.function, which TF reports as a tf.errors.OpError naming it) or a hosts update.
With `--in-place` a survivor of a lost worker re-forms the job in its own process instead, as
Horovod's elastic loop does: a new connection (`_TensorFlow.reinit`), the newest commit, the reset
callbacks, and the training function again; its models, optimizers and traced steps are kept.

As Horovod's, each state also keeps its last commit in memory: `restore()` reverts this worker's
variables and attributes to it (no collective), `sync()` gives every worker rank 0's state, and
`commit()` is `save()` (the copy in memory, and the file in an elastic job) then `check_host_updates()`.
A commit file holds a header (the key), then the whole payload: variables as numpy arrays, and the
attributes (None, bool, int, float, str, numpy arrays, tf.Tensors, and lists, tuples and dicts of
them), msgpack through sluice.tensorflow's object codec: a file never runs code.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TypeVar

import numpy as np
import tensorflow as tf

from sluice.errors import SluiceError
from sluice.worker.elastic import host
from sluice.worker.elastic import state as shared
from sluice.worker.elastic.host import (
    Commit,
    CommitFiles,
    CommitFormat,
    HostsUpdatedInterrupt,
    reform,
    watch_host_updates,
)
from sluice.worker.objects_codec import NUMPY_DTYPES
from sluice.worker.tensorflow.collectives import broadcast_variables
from sluice.worker.tensorflow.objects import CODEC, allgather_object, broadcast_object
from sluice.worker.tensorflow.state import NAMES, STATE, init, reinit_in_place, require, shutdown

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]

_KEY = ("format", "generation", "commit", "rank")


def _save(payload: dict[str, Any], out: BinaryIO) -> None:
    head = CODEC.dumps({k: payload[k] for k in _KEY if k in payload})
    out.write(len(head).to_bytes(8, "little"))
    out.write(head)
    out.write(CODEC.dumps(payload))


def _load(path: Path, key_only: bool) -> Any:
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        head = file.read(size)
        if len(head) != size:
            raise ValueError("the file ends inside its header")
        return CODEC.loads(head if key_only else file.read())


FILES = CommitFiles(CommitFormat(".msgpack", _save, _load, (), "sluice.tensorflow.elastic"))


def _sluice_failure(exc: BaseException) -> bool:
    """A SluiceError, or a TF error that one caused: eagerly its cause; from a tf.function's py_function,
    TF's message names the Python exception's class."""
    seen: BaseException | None = exc
    while seen is not None:  # the causes raised `from` it (the eager TF errors of a collective)
        if isinstance(seen, SluiceError):
            return True
        seen = seen.__cause__
    return _sluice_line(exc) is not None


def _sluice_line(exc: BaseException) -> str | None:
    """The line of a TF error's message that names the Sluice error behind it (raised in a py_function)."""
    if not isinstance(exc, tf.errors.OpError):
        return None
    names, pending = [], [SluiceError]
    while pending:
        cls = pending.pop()
        names.append(cls.__name__)
        pending.extend(cls.__subclasses__())
    found = re.search(rf"\b({'|'.join(names)}): .*", exc.message or "")
    return found.group(0) if found is not None else None


def _said(exc: BaseException) -> BaseException:
    """What to say of a failure: a TF error's Sluice line alone (its message holds TF's whole traceback)."""
    line = _sluice_line(exc)
    return SluiceError(line) if line is not None else exc


class _TensorFlow(shared.Backend):
    files = FILES
    plain = (np.ndarray, tf.Tensor)
    plain_what = "numpy arrays, tf.Tensors"
    #: NAMES' position where the training function was last entered (run), which a newcomer reaches too
    names_at_run = 0

    def initialized(self) -> bool:
        return STATE.node is not None

    def rank(self) -> int:
        return require().rank

    def optimizer_on(self) -> str:
        return STATE.settings.optimizer_on

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return allgather_object(obj, name=name)

    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any:
        return broadcast_object(obj, root_rank, name=name)

    def failed(self, exc: BaseException) -> bool:
        return super().failed(exc) or _sluice_failure(exc)

    def reform(self, reason: BaseException, commits: int) -> NoReturn:
        reform(_said(reason), commits, shutdown)

    def reinit(self, reason: BaseException, commits: int) -> bool:
        """--in-place: a new connection in this process (reinit_in_place, init). What was made on the old
        one follows by itself: the optimizers' and tapes' averagers take the new engine, and traced
        steps the new reducers (gradients.py, overlap.py). Unnamed calls are numbered again from where
        `run` began, as the newcomer, which runs the script afresh, numbers them."""
        host.reform_in_place(_said(reason), commits, reinit_in_place, init)
        NAMES.rewind(self.names_at_run)
        return True


TENSORFLOW = _TensorFlow()
host.fail_on_reform(lambda: STATE.node)  # what SIGUSR2 fails (--in-place): this process's connection then


class State(shared.State):
    """What Horovod's State offers: reset callbacks, commit, check_host_updates, save, restore, sync."""

    framework = TENSORFLOW


class ObjectState(shared.ObjectState, State):
    """Plain attributes given as keyword arguments (Horovod's ObjectState: `bcast_object` and `get_rank` are
    accepted and not needed: Sluice's broadcast_object and rank serve)."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._saved_attributes = copy.deepcopy(self._attributes())

    def save(self) -> None:
        """Keep the state as the last commit, in memory and (in an elastic job) in this host's file."""
        self._saved_attributes = copy.deepcopy(self._attributes())
        super().save()

    def restore(self) -> None:
        """Undo what changed since the last commit, on this worker only."""
        for name, value in copy.deepcopy(self._saved_attributes).items():
            setattr(self, name, value)

    def sync(self, root_rank: int = 0) -> None:
        super().sync(root_rank)
        self._saved_attributes = copy.deepcopy(self._attributes())


def _numpy(variable: Any) -> np.ndarray:
    """A copy of the variable's value; bfloat16 and float8 ones as float32 (exact), which the codec carries."""
    value = np.array(variable.numpy(), copy=True)
    return value if value.dtype.name in NUMPY_DTYPES else value.astype(np.float32)


class _VariablesState(ObjectState):
    """Groups of variables (tf.Variable or keras.Variable) and plain attributes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._saved_values = self._values()

    def _groups(self) -> dict[str, list[Any]]:
        raise NotImplementedError

    def _values(self) -> dict[str, list[np.ndarray]]:
        return {group: [_numpy(v) for v in variables] for group, variables in self._groups().items()}

    def _assign(self, values: dict[str, list[Any]], where: str) -> None:
        groups = self._groups()
        for group, variables in groups.items():
            saved = values.get(group)
            if saved is None or [tuple(np.shape(a)) for a in saved] != [tuple(v.shape) for v in variables]:
                raise ValueError(f"{where} has other {group} variables than this state ({len(variables)}): the "
                                 "script's model or optimizer changed since it was committed; start the job afresh")
        for group, variables in groups.items():
            for variable, value in zip(variables, values[group], strict=True):
                variable.assign(tf.cast(value, variable.dtype))

    def save(self) -> None:
        self._saved_values = self._values()
        super().save()

    def restore(self) -> None:
        self._assign(self._saved_values, "the last commit")
        super().restore()

    def sync(self, root_rank: int = 0) -> None:
        for variables in self._groups().values():
            broadcast_variables(variables, root_rank)
        super().sync(root_rank)
        self._saved_values = self._values()

    def _payload(self) -> dict[str, Any]:
        return {**super()._payload(), "variables": self._saved_values}  # save() has just taken them

    def _load(self, commit: Commit) -> None:
        self._assign(commit.payload.get("variables", {}), f"the elastic commit {commit.path}")
        super()._load(commit)


class TensorFlowKerasState(_VariablesState):
    """A built Keras model, its optimizer (`optimizer`, else the model's own) and plain attributes. The
    optimizer is built (its slots made) where it is not yet, so that every worker commits and receives
    the same variables. `backend` is Horovod's TF1 session holder, not needed."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer: Any = optimizer or getattr(model, "optimizer", None)
        if self.optimizer is None:
            raise ValueError("no optimizer: pass optimizer=, or compile the model with one first")
        self.backend = backend
        super().__init__(**kwargs)

    def _groups(self) -> dict[str, list[Any]]:
        if not getattr(self.optimizer, "built", True):
            self.optimizer.build(self.model.trainable_variables)
        variables = self.optimizer.variables  # a list in Keras 3, a method in tf.keras 2
        return {"model": list(self.model.variables), "optimizer": list(variables() if callable(variables)
                                                                        else variables)}


class TensorFlowState(_VariablesState):
    """A list of variables (default: TF1's global variables, none when eager) and plain attributes.
    `session` is Horovod's TF1 argument, not needed."""

    def __init__(self, variables: list[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables) if variables else list(tf.compat.v1.global_variables())
        self.session = session
        super().__init__(**kwargs)

    def _groups(self) -> dict[str, list[Any]]:
        return {"variables": self.variables}


F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Horovod's decorator for the training function `func(state, ...)` (worker/elastic/state.py's run):
    in an elastic job, the job's newest commit first (and the reset callbacks in a re-formed job), and a
    Sluice failure or HostsUpdatedInterrupt ends the process with status REFORM; outside one, rank 0's
    state first. With --in-place, a failure re-forms the job in this process (_TensorFlow.reinit) and
    `func` runs again from the newest commit."""
    elastic = shared.run(func, TENSORFLOW)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        TENSORFLOW.names_at_run = NAMES.position()
        return elastic(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


watch_host_updates()
