"""The PyTorch shim's process-wide state: the node, the worker settings, updates still in flight."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from sluice.errors import SluiceError
from sluice.transport.metrics import summary_lines
from sluice.worker.config import WorkerConfig
from sluice.worker.node import WorkerNode
from sluice.worker.staging import wire_dtype

log = logging.getLogger("sluice.worker")


@dataclass
class State:
    node: WorkerNode | None = None
    settings: WorkerConfig = field(default_factory=WorkerConfig)


STATE = State()
#: the node after shutdown(): init() takes it back (its connection lasts until the process exits)
PARKED: list[WorkerNode] = []
#: names for unnamed collectives, the same sequence on every worker
NAMES = itertools.count()
#: DistributedOptimizers made in this process, numbered alike on every worker (their names stay apart)
OPTIMIZERS = itertools.count()
class Waitable(Protocol):
    def wait(self) -> None: ...


#: id(parameter) -> (handle, finish): updates the next forward pass must finish before a module runs
PENDING: dict[int, tuple[Waitable, Callable[[], Any]]] = {}


def require() -> WorkerNode:
    if STATE.node is None:
        raise SluiceError("call init() first")
    return STATE.node


def declare_missing(named: Iterable[tuple[str, torch.Tensor]], options: Mapping[str, Any] | None = None) -> None:
    node = require()
    table = [
        (name, tuple(t.shape), wire_dtype(t), (options or {}).get(name))
        for name, t in named
        if not node.ps.declared(name)
    ]
    node.ps.declare(table)


def log_metrics(snapshot: Mapping[str, Any], when: str, rank: int | None = None) -> None:
    for line in summary_lines(snapshot, f"worker {require().rank if rank is None else rank} transport, {when}"):
        log.info("%s", line)

