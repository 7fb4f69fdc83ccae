"""DistributedOptimizer's arguments and parameter names, checked as Horovod checks them; errors say what to do."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sluice.errors import InvalidCallError
from sluice.worker.torch.collectives import Adasum, Average, Sum
from sluice.worker.torch.compression import Compressor
from sluice.worker.torch.fusion import Reduction


@dataclass(frozen=True)
class Options:
    reduction: Reduction = field(default_factory=Reduction)
    backward_passes_per_step: int = 1
    groups: int | list[list[int]] | None = None
    sparse_as_dense: bool = False


class Done:
    """A wait that is over at once (the work happens in the finish callback)."""

    def wait(self) -> None:
        return None


def parse_options(compression: type[Compressor], backward_passes_per_step: int, op: str,
                  gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                  params: list[torch.Tensor]) -> Options:
    """Horovod's arguments, checked as Horovod checks them, with what to do instead in each error."""
    if op == Adasum:  # one worker (more take adasum_optimizer.py): Adasum of one gradient is that gradient
        op = Sum
    if op not in (Average, Sum):
        raise InvalidCallError(f"DistributedOptimizer reduces gradients by hvd.Average or hvd.Sum, not {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidCallError("gradient_predivide_factor not supported with op != Average (it splits the averaging)")
    if not gradient_predivide_factor > 0:
        raise InvalidCallError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
    if type(backward_passes_per_step) is not int or backward_passes_per_step < 1:
        raise InvalidCallError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
    if not (isinstance(compression, type) and issubclass(compression, Compressor)):
        raise InvalidCallError("compression must be hvd.Compression.none, .fp16 or .bf16")
    plan: int | list[list[int]] | None = None
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise InvalidCallError(f"groups must be a positive int or a list of lists of parameters, got {groups}")
        plan = groups or None
    elif groups is not None:
        ids = {id(p) for p in params}
        plan = [[id(p) for p in group] for group in groups]
        flat = [key for group in plan for key in group]
        if any(key not in ids for key in flat) or len(flat) != len(set(flat)):
            raise InvalidCallError("groups must list parameters of this optimizer, each at most once")
    return Options(Reduction(op, float(gradient_predivide_factor), compression.wire_dtype),
                    backward_passes_per_step, plan, bool(sparse_as_dense))


class LocalMixin:
    """A DistributedOptimizer on a worker outside its process set, as Horovod's: it steps on local gradients."""

    def synchronize(self) -> None:
        return None

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's idiom `synchronize(); clip...; with skip_synchronize(): step()`: after
        synchronize() nothing is left to wait for, so step() updates every parameter at once."""
        yield


def local_only(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` as a DistributedOptimizer of a process set this worker is not in."""
    base: Any = optimizer.__class__
    cls: Any = type(base.__name__, (LocalMixin, base), {})
    wrapped: Any = cls.__new__(cls)
    base.__init__(wrapped, optimizer.param_groups)
    return wrapped  # type: ignore[no-any-return]


def named_parameters_of(groups: list[dict[str, Any]], named_parameters: Iterable[tuple[str, torch.Tensor]] | None
                        ) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters with their names, checked as Horovod checks them (ValueError); without
    named_parameters, Horovod's default names `allreduce.noname.<group>.<index>`."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(groups)
                for j, p in enumerate(group["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise InvalidCallError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                               "by model.named_parameters().")
    counts = collections.Counter(name for name, _ in named)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise InvalidCallError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                               f"{', '.join(map(str, duplicates))}")
    ids = {id(p) for _, p in named}
    unnamed = [id(p) for group in groups for p in group["params"] if id(p) not in ids]
    if unnamed:
        raise InvalidCallError("named_parameters was specified, but one or more model parameters were not named. "
                               f"Python object ids: {', '.join(map(str, unnamed))}")
    return named
