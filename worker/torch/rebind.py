"""What a DistributedOptimizer holds of its connection, made again when an elastic job re-forms in place.

With `sluice launch --elastic --in-place` the survivors of a lost worker keep their process and join
the re-formed job with a new connection (worker/torch/elastic.py). Their DistributedOptimizers were
made on the old one: its collective engine, the handles of the step that failed, the fused buffers,
the parameter priorities and routes. `rebind_all` drops those and takes the new connection's, as a
freshly made optimizer would; the parameters, their hooks and the optimizer's own state stay.
"""

from __future__ import annotations

import weakref
from typing import Any, TypeVar

from sluice.worker.torch.calls import member_engine
from sluice.worker.torch.fusion import choose_routes
from sluice.worker.torch.priority import ParameterPriorities
from sluice.worker.torch.state import STATE, require

T = TypeVar("T")
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def track(optimizer: T) -> T:
    """Remember a DistributedOptimizer of this process (weakly), to rebind it later; returns it."""
    _LIVE.add(optimizer)
    return optimizer


def rebind_all() -> None:
    """Bind every DistributedOptimizer of this process to the connection init() just made."""
    for optimizer in list(_LIVE):
        rebind(optimizer)


def rebind(optimizer: Any) -> None:
    node = require()
    engine = member_engine(optimizer._sluice_process_set)
    if engine is not None:
        optimizer._sluice_engine = engine
    optimizer._sluice_handles, optimizer._sluice_stages, optimizer._sluice_passes = {}, {}, {}
    optimizer._sluice_fused, optimizer._sluice_flushed, optimizer._sluice_completed = None, False, False
    in_order = [(optimizer._sluice_names[key], param) for key, param in optimizer._sluice_params.items()]
    optimizer._sluice_routes = choose_routes([(n, p) for n, p in in_order if p.requires_grad],
                                             node.collective_settings, node.hosts("worker"), node.hosts("server"))
    if engine is not None and engine.set_id and node.by_rank("aggregator"):
        optimizer._sluice_routes = dict.fromkeys(optimizer._sluice_routes, "allreduce")
    optimizer._sluice_priorities = ParameterPriorities(node, STATE.settings, in_order, None)
