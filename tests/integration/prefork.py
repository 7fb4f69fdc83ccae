"""Imports every process forked from the test process (testbed/cluster.py) would otherwise make again, each on
its own: made once here, before forking. A test module imports this module, and calls `torch_workers()` or
`torch_optimizers()` if its workers use torch."""

from __future__ import annotations

import sluice.ps.aggregator  # the aggregators'
import sluice.ps.server  # the servers'
import sluice.scheduler.service  # the scheduler's (its tree planner imports scipy: a second or so)
import sluice.worker.node  # noqa: F401 - the workers'


def torch_workers() -> None:
    """torch and sluice.torch (seconds)."""
    import torch  # noqa: F401

    import sluice.torch  # noqa: F401


def torch_optimizers() -> None:
    """torch_workers(); and the first optimizer a process builds imports torch._dynamo (seconds): build one."""
    torch_workers()
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
