"""DistributedOptimizer(op=hvd.Adasum), Horovod's delta optimizer: each worker steps on its own gradients,
then the workers' updates (the deltas of the parameters) are combined by Adasum (worker/torch/adasum.py).

As Horovod's `_DistributedAdasumOptimizer`: the wrapped optimizer steps every parameter locally, the
change each step made is combined over the ranks, and every rank sets its parameters to where they
were plus the combined change, so the ranks stay equal. `synchronize()` has nothing to do, and
`skip_synchronize()` raises AssertionError, as Horovod's does. It runs when `step()` is called (the
deltas exist only then), so nothing overlaps the backward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from sluice.worker.torch.collectives import Adasum, allreduce_async_, synchronize
from sluice.worker.torch.options import named_parameters_of


class AdasumMixin:
    """Mixed in front of the user's optimizer class (isinstance and LR schedulers keep working)."""

    param_groups: list[dict[str, Any]]

    def _sluice_adasum_setup(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None, prefix: str) -> None:
        named = named_parameters_of(self.param_groups, named_parameters)
        #: Horovod's attribute: each parameter's name
        self._parameter_names = {p: name for name, p in named}
        names = {id(p): f"adasum.{prefix}{name}" for name, p in named}
        #: the parameters whose updates are combined: those that required gradients when it was made,
        #: the same on every rank (one that gets no gradient here moves by zero)
        self._sluice_adasum = [(names[id(p)], p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        starts = [p.detach().clone() for _, p in self._sluice_adasum]
        loss: float | None = super().step(closure)  # type: ignore[misc]
        handles = []
        with torch.no_grad():
            for (name, param), start in zip(self._sluice_adasum, starts, strict=True):
                handles.append(allreduce_async_(param.detach() - start, name=name, op=Adasum))
            for (_, param), start, handle in zip(self._sluice_adasum, starts, handles, strict=True):
                param.copy_(start + synchronize(handle))
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: the updates are combined in step()."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover


def adasum_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                     prefix: str) -> torch.optim.Optimizer:
    """`optimizer`'s class with the Adasum delta step in front, over the same parameter groups."""
    base: Any = optimizer.__class__
    cls: Any = type(base.__name__, (AdasumMixin, base), {})
    wrapped: Any = cls.__new__(cls)
    base.__init__(wrapped, optimizer.param_groups)
    wrapped._sluice_adasum_setup(named_parameters, prefix)
    return wrapped  # type: ignore[no-any-return]
