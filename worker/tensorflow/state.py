"""The TensorFlow and Keras shims' process-wide state: the node, the worker settings, where this worker runs."""

from __future__ import annotations

import atexit
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import CollectiveError, SluiceError
from sluice.transport.metrics import summary_lines
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.process_set import ProcessSet, register_sets, set_id, sets_of
from sluice.worker.config import WorkerConfig
from sluice.worker.node import WorkerNode
from sluice.worker.shim import show_our_logs, worker_settings
from sluice.worker.topology import Placement, placement

log = logging.getLogger("sluice.worker")


@dataclass
class State:
    node: WorkerNode | None = None
    settings: WorkerConfig = field(default_factory=WorkerConfig)
    placement: Placement | None = None


STATE = State()
#: numbers for unnamed collectives and for gradient sets: the same sequence on every worker
NAMES = itertools.count()


def require() -> WorkerNode:
    if STATE.node is None:
        raise SluiceError("call init() first")
    return STATE.node


def engine(process_set: Any = None) -> CollectiveEngine:
    """The engine that runs collectives over `process_set` (None or hvd.global_process_set: every worker).
    Its `rank` and `size` are this worker's within the set."""
    return sets_of(require()).engine(set_id(process_set), "collective")


def member_engine(process_set: Any = None) -> CollectiveEngine | None:
    """The engine of `process_set`, or None where this worker is not in the set (Horovod then leaves its
    gradients as they are); CollectiveError for a set that is not registered."""
    return sets_of(require()).member_engine(process_set)


def process_set_ranks(process_set: Any = None) -> list[int]:
    """The global ranks of `process_set` (None: every worker); CollectiveError for a set not registered."""
    ranks = sets_of(require()).ranks_of(process_set)
    if ranks is None:
        raise CollectiveError("Process set provided does not exist, or has not been registered.")
    return ranks


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join the job this process was launched into (by `sluice launch`); a second call does nothing.
    `process_sets` (Horovod's): sets to register at once, in the same order on every worker, or "dynamic"."""
    if comm is not None:
        raise SluiceError("init(comm=...) takes an MPI communicator, and Sluice does not use MPI: call hvd.init() "
                          "and choose the workers with sluice launch -w N")
    if STATE.node is not None:
        return
    show_our_logs()
    node = WorkerNode()
    settings = worker_settings(node)
    if settings.optimizer_on != "worker":
        node.close()
        raise SluiceError("the TensorFlow and Keras shims run the optimizer on the workers: "
                          "set worker.optimizer_on = 'worker' (the servers then only sum gradients)")
    STATE.settings, STATE.node = settings, node
    STATE.placement = placement(node.hosts("worker"), node.rank)
    atexit.register(shutdown)
    assert node.process_sets is not None
    register_sets(node.process_sets, node.rank, process_sets)


def shutdown() -> None:
    """Leave the job (at exit by itself); init() may join a new one afterwards."""
    node = STATE.node
    if node is not None:
        if node.rank == 0:
            log_metrics(node.stats(), "at the end")
        node.close()
        STATE.node, STATE.placement = None, None


def log_metrics(snapshot: dict[str, Any], when: str) -> None:
    for line in summary_lines(snapshot, f"worker {require().rank} transport, {when}"):
        log.info("%s", line)


def current_placement() -> Placement:
    require()
    assert STATE.placement is not None
    return STATE.placement
