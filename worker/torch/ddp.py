"""DDP in one line: `model.register_comm_hook(None, sluice.torch.ddp_hook)` sends DDP's gradient buckets through Sluice.

A DistributedDataParallel model keeps its process group (under `sluice launch`, the torchrun
variables RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, so `init_process_group("gloo")`
works unchanged) for what DDP does once (broadcasting the module's state, finding unused parameters),
while every gradient bucket goes through Sluice: by allreduce among the workers or through the
parameter servers (chosen as for DistributedOptimizer: `collective.mode` and its patterns), with
priorities: a bucket holding earlier layers (a higher bucket index: DDP fills buckets in reverse
order) is more urgent, so at every hop it overtakes the buckets of later layers. The hook returns
a torch Future completed from Sluice's I/O thread with the averaged bucket, in place.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects (GradBucket, Future)
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sluice.worker.staging import Staging, wire_dtype
from sluice.worker.torch.fusion import choose_routes
from sluice.worker.torch.state import STATE, require


@dataclass
class DDPHookState:
    """What the hook keeps between buckets; pass one as `state` to choose the route ("auto": as
    collective.mode says, "allreduce" or "ps")."""

    route: str = "auto"
    #: buckets in the last complete backward pass: priorities put the highest index first
    buckets: int = 0
    _seen: int = 0
    _declared: set[str] = field(default_factory=set)
    _priorities: dict[str, int] = field(default_factory=dict)
    _routes: dict[str, str] = field(default_factory=dict)


_DEFAULT = DDPHookState()


def _init() -> None:
    if STATE.node is None:
        from sluice.worker.torch.api import init

        init()


def ddp_hook(state: DDPHookState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """DDP's communication hook: the bucket averaged over every worker through Sluice."""
    _init()
    hook_state = state if isinstance(state, DDPHookState) else _DEFAULT
    node = require()
    buffer: torch.Tensor = bucket.buffer()
    index = int(bucket.index())
    hook_state._seen = max(hook_state._seen, index + 1)
    if bucket.is_last():
        hook_state.buckets, hook_state._seen = hook_state._seen, 0
    # DDP may rebuild its buckets after the first step: a name holds the size, so a new layout is new names
    name = f"ddp.bucket{index}.{buffer.numel()}.{wire_dtype(buffer)}"
    priority = max(hook_state.buckets - 1 - index, 0)
    route = hook_state._routes.get(name)
    if route is None:
        route = hook_state.route
        if route == "auto":
            route = choose_routes([(name, buffer)], node.collective_settings, node.hosts("worker"),
                                  node.hosts("server"))[name]
        hook_state._routes[name] = route
    stage = Staging(buffer)
    array = stage.load(buffer)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    size = node.size

    def settle(error: str | None) -> None:
        if error is not None:
            future.set_exception(RuntimeError(f"sluice ddp_hook, bucket {index}: {error}"))  # type: ignore[arg-type]
            return
        stage.store(buffer)
        if route == "ps":  # the servers sum; the engine averages by itself
            buffer.div_(size)
        future.set_result(buffer)

    if route == "ps":
        if name not in hook_state._declared:
            node.ps.declare([(name, tuple(array.shape), wire_dtype(buffer), None)])
            hook_state._declared.add(name)
        if hook_state._priorities.get(name) != priority:
            node.ps.set_priorities({name: priority})
            hook_state._priorities[name] = priority
        node.ps.push_pull(name, array, array).add_done_callback(lambda h: settle(h.error))
    else:
        engine = node.collectives
        assert engine is not None
        engine.allreduce(name, [array], wire_dtype(buffer), "average", priority).add_done_callback(
            lambda h: settle(h.error))
    return future
