"""A fused group summed in three steps: inside the host, each local rank's share across hosts, gathered back.

BytePS's hierarchy (OSDI'20) on Sluice's own engines: the workers of a host sum a fused group by
allreduce on their host's set (shared memory: measured faster on the CPU than gloo's reduce-scatter,
bench/results/local_group.md); each local rank then takes its share (`share_bounds`) across the hosts,
by allreduce on the set of the workers with its local rank or through the servers (a key per share,
declared by that set); and an allgather on the host's set puts the shares back in place, into the
group's own buffer (no copy). So a worker sends 1/local_size of the group across hosts instead of
all of it.

The steps are chained by their completions; the next is issued on a thread of its own, never on the
I/O thread that completes the last (a push may wait there for credit the I/O thread returns). The
engines negotiate each step by name, so the ranks may issue them in any order. A share whose
crossing fails is still gathered, so that every worker of the host stays in step, and the group then
fails with the crossing's error; a sum that fails inside a host (its workers disagree on the group's
layout) is refused at the crossing by that host's workers, so it fails on every host alike.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.negotiation_request import data_op, scaled_op
from sluice.worker.collective.ops import OpHandle
from sluice.worker.topology import share_bounds

log = logging.getLogger(__name__)

#: push_pull(key, data, out): a share's round through the servers (worker/client.py); its handle
PushPull = Callable[[str, np.ndarray, np.ndarray], Any]


def share_key(name: str, local_rank: int) -> str:
    """The servers' key of one local rank's share of a fused group."""
    return f"{name}.share{local_rank}"


class Hierarchy:
    """This worker's place in the hierarchy: its host's engine and its local rank's engine across hosts."""

    def __init__(self, local: CollectiveEngine, cross: CollectiveEngine, job: CollectiveEngine, timeout: float) -> None:
        """`job`: the job's engine (every worker's checks before a share's key is declared)."""
        self.local, self.cross, self.job, self._timeout = local, cross, job, timeout
        self.local_rank, self.local_size = local.rank, local.size
        #: the job ranks that share this worker's local rank, one per host (a share key's declaring set)
        self.cross_ranks = list(cross.members)
        #: fused groups summed this way (a job's check that the hierarchy ran)
        self.groups = 0
        self._steps = StepThread("sluice-hierarchy")

    def takes(self, nbytes: int, through_servers: bool = False) -> bool:
        """Whether a sum of `nbytes` takes the hierarchy: through the servers always (each worker pushes its share
        only); by allreduce where the engine would take its ring (collective.tree_below_bytes), since its tree,
        which the smaller ones take, is built by host and crosses each host's link about as the hierarchy does
        (bench/results/hierarchy.md)."""
        return through_servers or nbytes >= self.job.settings.tree_below_bytes

    def share(self, length: int) -> tuple[int, int]:
        """This worker's share [start, end) of a flat group of `length` elements."""
        return share_bounds(length, self.local_size)[1][self.local_rank]

    def allreduce(self, name: str, flat: np.ndarray, dtype: str, priority: int,
                  layout: tuple[tuple[int, ...], ...] | None = None, push_pull: PushPull | None = None,
                  op: str = "sum", scale: tuple[float, float] | None = None) -> OpHandle:
        """Sum `flat` (1-D, registered) over every worker of the job, in place; across hosts by allreduce, or
        through the servers with `push_pull` (this rank's share key declared). Its handle completes when the
        sum is in `flat`. Where the host's workers disagree on the `layout` (the shapes a fused group holds),
        it fails on every worker of the job: the host's refuse the crossing, which fails it on the others.
        `op` and `scale` as the engine's allreduce takes them (Horovod's API: min, max, product, or an average
        the caller scales); the crossing runs the reduction the data plane ran inside the host."""
        done = OpHandle(f"hierarchical allreduce {name!r}", self._timeout)
        self.groups += 1
        start, end = self.share(flat.size)
        share = flat[start:end]
        summed = self.local.allreduce(f"{name}.local", [flat], dtype, op, priority, scale=scale, layout=layout)
        crossing_op = data_op(scaled_op(op, *scale) if scale is not None else op)

        def cross() -> None:
            done.started = summed.started  # the timeline's NEGOTIATE: until the host's sum was decided
            if summed.error is not None:  # every worker of the host saw it fail alike: none gathers
                error = f"inside the host of workers {self.local.members} (ranks 0.. there): {summed.error}"
                if push_pull is None:  # the other hosts' workers of this local rank fail at the crossing
                    self.cross.refuse(f"{name}.cross", error)
                done.finish(error=error)
                return
            if share.size == 0:  # every worker of this local rank has an empty share of a small group
                gather(None)
                return
            try:
                if push_pull is not None:
                    handle = push_pull(share_key(name, self.local_rank), share, share)
                else:
                    handle = self.cross.allreduce(f"{name}.cross", [share], dtype, crossing_op, priority)
            except Exception as exc:  # the node failed, say: the host's other workers still wait to gather
                gather(f"{type(exc).__name__}: {exc}")
                return
            handle.add_done_callback(lambda h: self._steps.put(lambda: gather(h.error)))

        def gather(crossing_error: str | None) -> None:
            try:
                gathered = self.local.allgather(f"{name}.gather", share, dtype, priority, out=flat)
            except Exception as exc:
                done.finish(error=crossing_error or f"{type(exc).__name__}: {exc}")
                return
            gathered.add_done_callback(lambda h: done.finish(error=crossing_error or h.error))

        summed.add_done_callback(lambda _: self._steps.put(cross))
        return done

    def close(self) -> None:
        self._steps.close()


class StepThread:
    """A thread of its own that runs queued steps in order: the next step of a chain, issued off the I/O
    thread that completed the last (a push may wait there for credit the I/O thread returns)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, step: Callable[[], None]) -> None:
        self._queue.put(step)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            try:
                step()
            except Exception:  # a bug: the thread goes on for the other steps; the failed one's wait names it
                log.exception("%s: a step failed", self._thread.name)
