"""What every TF collective call shares: Horovod's op names, a call's name, its checks, its requests kept in step.

A call draws its name before any check (unnamed calls are numbered alike on every rank, per process
set: only a set's members call on it), then runs its checks inside `checking`: where they fail here,
the call fails on every rank too (worker/collective/refusal.py). A refusal fails the requests of that
name only, so a call that needs several engine requests makes its first one under the call's own
name and waits for it before it submits the others (`in_step`): a refused call then stops at its
first request on every rank, and none is left waiting. The calls' gradients are tf.custom_gradient
functions, which get their upstream gradients through `upstream`; the public calls are marked for
AutoGraph to call them as they are (`not_converted`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import tensorflow as tf

from sluice.errors import CollectiveError, InvalidCallError
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.refusal import refusing
from sluice.worker.tensorflow.state import NAMES, STATE

#: Horovod's reduction ops (horovod.tensorflow.Average, Sum, Adasum, Min, Max, Product)
Average, Sum, Adasum, Min, Max, Product = "average", "sum", "adasum", "min", "max", "product"
OPS = (Average, Sum, Adasum, Min, Max, Product)

#: tf.custom_gradient, typed (TensorFlow has no type hints): f(*tensors) -> (outputs, gradient function)
custom_gradient: Callable[[Callable[..., Any]], Callable[..., Any]] = tf.custom_gradient

F = TypeVar("F", bound=Callable[..., Any])

#: numbers for unnamed calls on each process set, by the set engine's label
_SET_NAMES: dict[str, Iterator[int]] = {}
_SET_NAMES_LOCK = threading.Lock()


def not_converted(fn: F) -> F:
    """`fn` as AutoGraph should call it inside a tf.function: unconverted. A collective's Python has no
    control flow on tensors, and converting it (and everything it calls) costs seconds per trace."""
    return cast(F, tf.autograph.experimental.do_not_convert(fn))


def upstream(dys: Sequence[Any], outputs: Sequence[Any]) -> list[Any]:
    """The gradients TF hands a custom gradient, dense and in the outputs' dtypes (TF may give float32
    zeros, or tf.IndexedSlices from a gather of the output), zeros where it gives None."""
    return [tf.zeros_like(y) if dy is None else tf.cast(tf.convert_to_tensor(dy), y.dtype)
            for dy, y in zip(dys, outputs, strict=True)]


def resolve_op(average: bool | None, op: str | None) -> str:
    """Horovod's op from `op` and the deprecated `average` flag (None and None: Average)."""
    if average is not None and op is not None:
        raise InvalidCallError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Sum if average is False else Average
    if op not in OPS:
        raise InvalidCallError(f"op must be Average, Sum, Adasum, Min, Max or Product, got {op!r}")
    return op


def collective_name(name: str | None, kind: str, on: CollectiveEngine | None = None) -> str:
    """The engine's name of a call, drawn before its checks: unnamed ones are numbered alike on every rank
    (of `on`'s process set: a set's engine has a label, and its own sequence)."""
    if name is not None:
        return name
    label = getattr(on, "label", "")
    if not label:
        return f"tf.{kind}.noname.{next(NAMES)}"
    with _SET_NAMES_LOCK:
        counter = _SET_NAMES.setdefault(label, itertools.count())
        return f"tf.{kind}.noname.{next(counter)}"


def checking(name: str, on: CollectiveEngine | None = None) -> Any:
    """Run a call's checks: where they fail here, the call fails on every rank of `on` (None: the job's
    engine) too (worker/collective/refusal.py)."""
    return refusing(name, _running_engine if on is None else lambda: on)


def _running_engine() -> CollectiveEngine | None:
    return STATE.node.collectives if STATE.node is not None else None


def in_step(submits: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run a call's engine requests: the first (which carries the call's name) alone, then the others at
    once; their results, in order. Every request has finished before an error is raised (the first
    CollectiveError), so none writes into an array after the call has returned."""
    results = [submits[0]().result()]
    handles = [submit() for submit in submits[1:]]
    failure: CollectiveError | None = None
    for handle in handles:
        try:
            results.append(handle.result())
        except CollectiveError as exc:
            failure = failure or exc
            results.append(None)
    if failure is not None:
        raise failure
    return results
