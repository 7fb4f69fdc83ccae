"""Parameter updates in flight: finish them and step their parameters before a module runs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from sluice.worker.torch.fusion import GroupWait
from sluice.worker.torch.state import PENDING


class Stepper(Protocol):
    """A DistributedOptimizer as seen from here: it steps the parameters given, with their gradients."""

    def _sluice_step_params(self, ready: list[tuple[int, torch.Tensor, dict[str, Any]]]) -> None: ...


#: (optimizer, parameter id, averaged gradient, settings at step()): updates waiting for step_ready()
READY: list[tuple[Stepper, int, torch.Tensor, dict[str, Any]]] = []


def step_ready() -> None:
    """Step every parameter whose averaged gradient is queued: one optimizer step per optimizer and
    group, not one per parameter (each step() costs Python tens of microseconds)."""
    while READY:
        ready = list(READY)
        READY.clear()
        by_optimizer: dict[int, tuple[Stepper, list[tuple[int, torch.Tensor, dict[str, Any]]]]] = {}
        for optimizer, key, grad, settings in ready:
            by_optimizer.setdefault(id(optimizer), (optimizer, []))[1].append((key, grad, settings))
        for optimizer, items in by_optimizer.values():
            optimizer._sluice_step_params(items)


def finish_updates(keys: Iterable[int] | None = None) -> None:
    """Wait for and apply the pending updates of `keys` (ids of parameters; None: all of them), then
    step the parameters whose averaged gradients that queued."""
    took = False
    for key in list(PENDING) if keys is None else keys:
        entry = PENDING.pop(key, None)
        if entry is not None:
            took = True
            entry[0].wait()
            entry[1]()
    if took:  # updates whose fused sums are in already join these: one optimizer step for all, not one per module
        # (measured on the demo model, one fused group: 4 steps of SGD a training step became 1)
        for key in [key for key, (wait, _) in PENDING.items() if isinstance(wait, GroupWait) and wait.arrived()]:
            wait, step_one = PENDING.pop(key)
            wait.wait()
            step_one()
    step_ready()


def synchronize_parameters() -> None:
    """Finish every parameter update still in flight (the next forward pass would), e.g. before saving."""
    finish_updates()


def wait_for_parameters(module: torch.nn.Module, args: Any) -> None:
    """The global forward pre-hook: a module runs once its own parameters' updates are finished."""
    if PENDING:
        finish_updates(id(param) for param in module._parameters.values() if param is not None)
