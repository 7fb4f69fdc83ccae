"""The TensorFlow and Keras shims' process-wide state: the node, the settings, where this worker runs, call numbers."""

from __future__ import annotations

import atexit
import logging
import threading
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


class Numbers:
    """0, 1, 2, ... by next(); `rewind` goes back to a `position()`, as a job re-formed in place does
    (elastic.py): its survivors then number their calls as the newcomer, which starts the script afresh."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()  # calls from TF's inter-op threads draw too

    def __iter__(self) -> Numbers:
        return self

    def __next__(self) -> int:
        with self._lock:
            self._next += 1
            return self._next - 1

    def position(self) -> int:
        """The number the next call gets."""
        return self._next

    def rewind(self, position: int) -> None:
        with self._lock:
            self._next = position


STATE = State()
#: numbers for unnamed collectives and for gradient sets: the same sequence on every worker
NAMES = Numbers()


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
    atexit.unregister(shutdown)  # once, however often init() runs (a job re-formed in place, reinit_in_place)
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


def reinit_in_place() -> None:
    """Drop this process's connection for good, failed as it is (an elastic job re-forms in place), so
    that the next init() joins the re-formed job with a new one. The node is let go before it closes:
    closing a failed one may outlast the wait elastic gives it (host.CLOSE_SECONDS)."""
    node, STATE.node, STATE.placement = STATE.node, None, None
    if node is not None:
        node.close()


def log_metrics(snapshot: dict[str, Any], when: str) -> None:
    for line in summary_lines(snapshot, f"worker {require().rank} transport, {when}"):
        log.info("%s", line)


def current_placement() -> Placement:
    require()
    assert STATE.placement is not None
    return STATE.placement
