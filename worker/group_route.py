"""How one route's fused gradient groups leave a worker, for both framework shims: declared, then sent.

Through the servers a group is a key of its own, declared by every worker (or by a process set's);
by allreduce it is a request of the engine with the group's layout. Where the job has a hierarchy
(worker/hierarchy.py: several workers on each of several hosts) the job's own groups are summed in
the host first: through the servers each local rank's share is then the key, declared by the workers
of that local rank, one per host, after every worker checked the groups are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sluice.errors import SluiceError
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.hierarchy import Hierarchy, share_key
from sluice.worker.node import WorkerNode


class GroupRoute:
    """One route's ("ps" or "allreduce") fused groups of one dtype: their names, sizes and how each is sent."""

    def __init__(self, node: WorkerNode, route: str, engine: CollectiveEngine | None, names: Sequence[str],
                 lengths: Sequence[int], dtype: str, priorities: Sequence[int],
                 layouts: Sequence[tuple[tuple[int, ...], ...]], greedy: bool = False) -> None:
        """`engine`: the process set's whose workers the groups are summed over (None: the job's)."""
        self.node, self.route, self.dtype = node, route, dtype
        self.engine = engine if engine is not None else node.collectives
        self.names, self.priorities, self.layouts = list(names), list(priorities), list(layouts)
        #: the job's groups are summed inside each host first where the job allows: not a process set's, not
        #: Horovod's greedy baseline, and through the servers only without aggregators (a share's key is its
        #: set's, and those go straight to the servers)
        self.hierarchy: Hierarchy | None = node.hierarchy() if (
            (engine is None or engine is node.collectives) and not greedy
            and (route == "allreduce" or not node.hosts("aggregator"))) else None
        if self.hierarchy is not None:
            self._check_lengths(list(lengths))
        if route == "ps":
            self._declare(list(lengths))
        elif self.engine is None:
            raise SluiceError("allreduce is not available: the collective engine did not start")

    def send(self, index: int, array: np.ndarray) -> Any:
        """Start summing group `index`, whose elements are `array` (1-D, registered), in place; its handle."""
        name, priority, servers = self.names[index], self.priorities[index], self.route == "ps"
        if self.hierarchy is not None and self.hierarchy.takes(array.nbytes, servers):
            # the servers check no shapes, flat or not: a refused sum would leave the other hosts' pushes waiting
            return (self.hierarchy.allreduce(name, array, self.dtype, priority, None, self.node.ps.push_pull)
                    if servers else self.hierarchy.allreduce(name, array, self.dtype, priority, self.layouts[index]))
        if servers:
            return self.node.ps.push_pull(name, array, array)
        assert self.engine is not None
        return self.engine.allreduce(name, [array], self.dtype, "sum", priority, layout=self.layouts[index])

    def cross(self, index: int, share: np.ndarray) -> Any:
        """Start summing across the hosts this worker's `share` of group `index`, which its host summed already
        (a device-resident group: worker/torch/device_hierarchy.py); without a hierarchy the share is the group."""
        if self.hierarchy is None:
            return self.send(index, share)
        name = self.names[index]
        if self.route == "ps":
            return self.node.ps.push_pull(share_key(name, self.hierarchy.local_rank), share, share)
        return self.hierarchy.cross.allreduce(f"{name}.cross", [share], self.dtype, "sum", self.priorities[index])

    def _check_lengths(self, lengths: list[int]) -> None:
        """Every worker's groups are the same, or every worker fails here, as a flat declaration does: a share's
        key is declared by its local rank's workers only, and a device-resident group's sum inside the host
        checks nothing."""
        assert self.hierarchy is not None
        job = self.hierarchy.job
        seen = np.asarray(job.allgather(f"{self.names[0]}.lengths", np.array(lengths, np.int64), "int64").result()
                          ).reshape(job.size, -1)
        if not (seen == seen[0]).all():
            differs = next(r for r in range(job.size) if not (seen[r] == seen[0]).all())
            raise SluiceError(f"the workers' gradients differ: worker {differs} has fused groups of "
                              f"{seen[differs].tolist()} elements, worker 0 of {seen[0].tolist()} ({self.route}, "
                              f"{self.dtype}): every worker must build the same model")

    def _declare(self, lengths: list[int]) -> None:
        """The groups' keys on the servers: each group's, or with the hierarchy this local rank's share of each."""
        ps, hierarchy = self.node.ps, self.hierarchy
        if hierarchy is None:
            members = self.engine.members if self.engine is not None and self.engine.set_id else None
            ps.declare([(name, (n,), self.dtype, None) for name, n in zip(self.names, lengths, strict=True)], members)
            ps.set_priorities(dict(zip(self.names, self.priorities, strict=True)))
            return
        shares = [(share_key(name, hierarchy.local_rank), hierarchy.share(n), priority)
                  for name, n, priority in zip(self.names, lengths, self.priorities, strict=True)]
        shares = [(key, (start, end), priority) for key, (start, end), priority in shares if end > start]
        if shares:  # every worker of this local rank has the same shares, or none
            ps.declare([(key, (end - start,), self.dtype, None) for key, (start, end), _ in shares],
                       hierarchy.cross_ranks)
            ps.set_priorities({key: priority for key, _, priority in shares})
