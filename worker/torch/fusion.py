"""Gradients as views of registered fusion buffers, sent in balanced groups through the servers or allreduce.

For each route ("ps" or "allreduce") and dtype, the parameters' gradients are laid out in one flat
buffer in backward order (worker/plan/fusion.py), allocated by the node in registered memory, and
every `param.grad` is made a view of it (DDP's gradient_as_bucket_view): autograd accumulates into
the buffer, and a fused group leaves with no copy. Two buffers alternate between steps, so the next
backward pass can fill one while the updates of the last step still read the other. A group is sent
the moment its last gradient is ready (the online split); its result comes back in place, is
averaged once, and each parameter's update waits only for the groups its gradient lies in.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sluice.errors import SluiceError
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.group_route import GroupRoute
from sluice.worker.node import WorkerNode
from sluice.worker.plan.fusion import Group, OnlineFusion, group_layout, grouped_plan, plan_fusion, unfused_plan
from sluice.worker.staging import wire_dtype
from sluice.worker.torch.device_hierarchy import DeviceHierarchy, device_hierarchy
from sluice.worker.torch.state import require as require_node

_TORCH_STORAGE = {torch.bfloat16: torch.int16}


def choose_routes(named: Sequence[tuple[str, torch.Tensor]], settings: CollectiveConfig, worker_hosts: Sequence[str],
                  server_hosts: Sequence[str]) -> dict[str, str]:
    """name -> "ps" or "allreduce" for every gradient.

    Patterns win; then `mode`. "auto" counts the machines: servers add bandwidth only on hosts of their
    own, so with n worker hosts and k server-only hosts it sends the largest tensors to the servers until
    they carry 2k(n-1) / (n^2 + kn - 2k) of the bytes (the share that balances both paths when every
    machine has the same link: BytePS, OSDI'20), the rest by allreduce. With no server-only host (all on
    one machine, say) that share is 0: measured on one host, 4 workers, the demo model trains at
    1.38x DDP by allreduce and 0.89x through 2 servers (bench/results/train_throughput*.json).
    """
    if not server_hosts:
        return {name: "allreduce" for name, _ in named}
    routes: dict[str, str] = {}
    for name, _ in named:
        if any(fnmatch.fnmatchcase(name, p) for p in settings.allreduce_patterns):
            routes[name] = "allreduce"
        elif any(fnmatch.fnmatchcase(name, p) for p in settings.ps_patterns):
            routes[name] = "ps"
        elif settings.mode != "auto":
            routes[name] = settings.mode
    free = [(t.numel() * t.element_size(), name) for name, t in named if name not in routes]
    n, k = len(set(worker_hosts)), len(set(server_hosts) - set(worker_hosts))
    target = ps_share(n, k) * sum(size for size, _ in free)
    placed, full = 0, target <= 0
    for size, name in sorted(free, key=lambda item: (-item[0], item[1])):
        full = full or placed + size / 2 > target  # the share is reached (to the nearest tensor)
        routes[name] = "allreduce" if full else "ps"  # small tensors all ride the allreduce's fused groups
        placed += 0 if full else size
    return routes


def ps_share(worker_hosts: int, server_hosts: int) -> float:
    """The share of gradient bytes "auto" sends to the servers: 2k(n-1) / (n^2 + kn - 2k)."""
    n, k = worker_hosts, server_hosts
    if k == 0:
        return 0.0
    return 1.0 if n == 1 else 2 * k * (n - 1) / (n * n + k * n - 2 * k)


@dataclass(frozen=True)
class Reduction:
    """How DistributedOptimizer reduces gradients (Horovod's options): Average or Sum, with
    gradient_predivide_factor f (each gradient times 1/f before the sum, the sum times f/size after),
    travelling in `wire` (compression: float16, bfloat16; None: their own dtype)."""

    op: str = "average"
    predivide: float = 1.0
    wire: torch.dtype | None = None

    def prescale(self) -> float:
        return 1.0 / self.predivide

    def postscale(self, size: int) -> float:
        return self.predivide / size if self.op == "average" else 1.0


@dataclass
class _Group:
    handle: Any = None
    averaged: bool = False


@dataclass
class StepGroups:
    """One step's sends: which buffer they came from and each group's handle."""

    buffer: int
    groups: list[_Group]


class GroupWait:
    """What one parameter's update waits for: the groups its gradient lies in, each averaged once."""

    def __init__(self, fused: FusedGradients, step: StepGroups, groups: Sequence[int]) -> None:
        self.fused, self.step, self._groups = fused, step, groups

    def wait(self) -> None:
        for index in self._groups:
            self.fused.finish_group(self.step, index)

    def arrived(self) -> bool:
        """Whether `wait` would return at once, without an error: each group's sum is in."""
        groups = [self.step.groups[i] for i in self._groups]
        return all(g.averaged or (g.handle is not None and g.handle.done() and g.handle.error is None) for g in groups)


class FusedGradients:
    """One route and dtype: its parameters' gradients in a double registered buffer, sent in groups."""

    def __init__(self, node: WorkerNode, route: str, params: Sequence[tuple[int, str, torch.Tensor]],
                 priorities: dict[int, int], fusion_bytes: int, reduction: Reduction = Reduction(),
                 groups: Sequence[Sequence[int]] | None = None, prefix: str = "",
                 engine: CollectiveEngine | None = None) -> None:
        """`engine`: the process set's (default: the job's) that takes the allreduce route."""
        self.node, self.route, self.reduction = node, route, reduction
        self.engine = engine if engine is not None else node.collectives
        #: the workers a group is summed over (a process set's, or every worker), on either route
        self.size = self.engine.size if self.engine is not None else node.size
        torch_dtype = params[0][2].dtype
        wire = reduction.wire if reduction.wire is not None and torch_dtype.is_floating_point else torch_dtype
        self.dtype = wire_dtype(torch.empty(0, dtype=wire))
        self.keys = [key for key, _, _ in params]
        sizes = [p.numel() * p.element_size() for _, _, p in params]
        item = params[0][2].element_size()
        order = list(range(len(params)))  # the caller gives them in backward order already
        # greedy fusion (allreduce only) negotiates each gradient alone and fuses what a cycle decides
        greedy = route == "allreduce" and node.collective_settings.fusion == "greedy"
        if groups is not None:
            self.plan = grouped_plan(sizes, groups)
        elif fusion_bytes and not greedy:
            self.plan = plan_fusion(sizes, order, fusion_bytes)
        else:
            self.plan = unfused_plan(sizes)
        self._online = OnlineFusion(self.plan)
        self._index = {key: i for i, key in enumerate(self.keys)}
        offsets = {slot.tensor: slot.offset for slot in self.plan.slots}
        count = self.plan.total_bytes // item
        device = params[0][2].device
        #: device-resident groups (collective.local_group): summed inside the host where they are, only this
        #: worker's share through the registered buffer (not a process set's, not compressed, not greedy)
        local = node.collective_settings.local_group
        self.device: DeviceHierarchy | None = device_hierarchy(node, device) if (
            wire == torch_dtype and not greedy and (engine is None or engine is node.collectives)
            and (local == "torch" or (local == "auto" and device.type == "cuda"))) else None
        self._arrays = [node.ps.alloc((count,), self.dtype) if self.device is None else
                        self.device.host_buffer(node.ps.alloc, count, self.dtype) for _ in range(2)]
        hosts = [torch.from_numpy(a) for a in self._arrays]
        if wire in _TORCH_STORAGE:
            hosts = [f.view(wire) for f in hosts]
        self._hosts = hosts
        #: where the gradients live: the registered buffers themselves on the CPU; on a GPU, or when they
        #: travel compressed, or stay where they are, buffers of their own, each group copied (cast) to its
        #: registered twin before it is sent and back when its result is in (the share alone, device-resident)
        self._on_device = device.type != "cpu" or wire != torch_dtype or self.device is not None
        flats = [torch.zeros(count, dtype=torch_dtype, device=device) for _ in range(2)] if self._on_device else hosts
        self._flats = flats
        self._views = [
            {key: flat[offsets[i] // item: offsets[i] // item + p.numel()].view(p.shape)
             for i, (key, _, p) in enumerate(params)}
            for flat in flats
        ]
        self._item = item
        self.active = 0
        self._groups_of = {key: [g.index for g in self.plan.groups if i in g.tensors] for key, i in self._index.items()}
        self.names = [f"{prefix}fusion.{route}.{self.dtype}.{g.index}" for g in self.plan.groups]
        #: what each group holds, for its request: ranks whose gradients differ fail there, on every rank
        self.layouts = [group_layout(self.plan, g.index, [tuple(p.shape) for _, _, p in params], item)
                        for g in self.plan.groups]
        #: each group's gradients, for the timeline
        self.members = [" ".join(params[t][1] for t in g.tensors) for g in self.plan.groups]
        self.priorities = [min((priorities.get(self.keys[t], 0) for t in g.tensors), default=0)
                           for g in self.plan.groups]
        self.step = self._new_step()
        lengths = [(g.end - g.start) // item for g in self.plan.groups]
        self.sending = GroupRoute(node, route, engine, self.names, lengths, self.dtype, self.priorities, self.layouts,
                                  greedy)

    def view(self, key: int) -> torch.Tensor:
        return self._views[self.active][key]

    def take(self, key: int, param: torch.Tensor) -> None:
        """Backward accumulated `param`'s gradient: make sure it lies in the buffer, send full groups."""
        view = self._views[self.active][key]
        grad = param.grad
        if grad is None:
            return
        if grad.data_ptr() != view.data_ptr():  # the first step, or the grad was reset to None meanwhile
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
        for group in self._online.cycle([self._index[key]]):
            self._send(group)

    def flush(self) -> None:
        """Backward is over: groups still missing a gradient (a parameter unused this step) go now."""
        for group in self._online.finish():
            self._send(group)

    def waits_for(self, key: int) -> GroupWait:
        return GroupWait(self, self.step, self._groups_of[key])

    def finish_group(self, step: StepGroups, index: int) -> None:
        group = step.groups[index]
        if group.averaged:
            return
        if group.handle is None:
            raise SluiceError(f"{self.names[index]} was never sent this step (flush() not called?)")
        group.handle.wait()
        plan_group = self.plan.groups[index]
        span = slice(plan_group.start // self._item, plan_group.end // self._item)
        part = self._flats[step.buffer][span]
        with torch.no_grad():
            if self._on_device and self.device is None:
                part.copy_(self._hosts[step.buffer][span])
            post = self.reduction.postscale(self.size)
            if post != 1.0:
                part.mul_(post)
        group.averaged = True

    def next_step(self, params: dict[int, torch.Tensor]) -> None:
        """Flip to the other buffer, zeroed, and point every gradient at it. The caller has finished
        the updates that read the other buffer (two steps ago)."""
        self.active ^= 1
        self._flats[self.active].zero_()
        for key, view in self._views[self.active].items():
            params[key].grad = view
        self._online.next_step()
        self.step = self._new_step()

    def _new_step(self) -> StepGroups:
        return StepGroups(self.active, [_Group() for _ in self.plan.groups])

    def _send(self, plan_group: Group) -> None:
        index = plan_group.index
        span = slice(plan_group.start // self._item, plan_group.end // self._item)
        with torch.no_grad():
            pre = self.reduction.prescale()
            if pre != 1.0:  # before the cast: predivision is there to keep low-precision sums in range
                self._flats[self.active][span].mul_(pre)
            if self._on_device and self.device is None:
                self._hosts[self.active][span].copy_(self._flats[self.active][span])
        array: np.ndarray = self._arrays[self.active][span]
        if self.device is not None:
            handle = self.device.allreduce(self.names[index], self._flats[self.active][span],
                                           self._hosts[self.active][span], array,
                                           lambda share: self.sending.cross(index, share),
                                           self.sending.hierarchy is not None)
        else:
            handle = self.sending.send(index, array)
        if self.node.trace is not None and (self.route == "allreduce" or self.sending.hierarchy is not None):
            self.node.trace.collective(self.names[index], "allreduce", self.priorities[index], array.nbytes, handle,
                                       self.members[index])
        self.step.groups[index].handle = handle


def build_fusion(params: dict[int, torch.Tensor], names: dict[int, str], routes: dict[str, str],
                 assigned: Sequence[Any], reduction: Reduction = Reduction(),
                 groups: int | Sequence[Sequence[int]] | None = None, prefix: str = "",
                 trained: Sequence[int] | None = None, engine: CollectiveEngine | None = None
                 ) -> dict[int, FusedGradients]:
    """The fused gradient sets of one optimizer, one per route, dtype and device: slots in backward
    order, which is the reverse of the order the forward pass first uses the parameters (the
    priority map; ties: the reverse of declaration order). The same on every rank, every step.
    `groups` (Horovod's): an int splits each set into that many balanced groups; lists of parameter
    ids are fused messages of their own (within each set), every other gradient goes alone. `prefix`
    starts the groups' names (one optimizer's apart from another's); `trained`: the parameters that get
    gradients (default: those that require them now)."""
    node = require_node()
    priority = {a.name: a.priority for a in assigned}
    declared = {key: i for i, key in enumerate(params)}
    if trained is None:
        trained = [key for key, p in params.items() if p.requires_grad]
    backward = sorted(trained, key=lambda k: (-priority.get(names[k], 0), -declared[k]))
    sets: dict[tuple[str, torch.dtype, str], list[tuple[int, str, torch.Tensor]]] = {}
    for key in backward:
        p = params[key]
        sets.setdefault((routes[names[key]], p.dtype, str(p.device)), []).append((key, names[key], p))
    by_key: dict[int, FusedGradients] = {}
    fusion_bytes = node.collective_settings.fusion_bytes
    for (route, _, _), members in sorted(sets.items(), key=lambda item: (item[0][0], str(item[0][1]), item[0][2])):
        explicit = None
        if isinstance(groups, int):
            total = sum(p.numel() * p.element_size() for _, _, p in members)
            fusion_bytes = max(-(-total // groups), 64)
        elif groups is not None:
            members, explicit = _user_groups(members, groups)
        fused = FusedGradients(node, route, members, {k: priority.get(names[k], 0) for k, _, _ in members},
                               fusion_bytes, reduction, explicit, prefix, engine)
        for key, _, _ in members:
            by_key[key] = fused
    return by_key


def _user_groups(members: list[tuple[int, str, torch.Tensor]], groups: Sequence[Sequence[int]]) -> tuple[
        list[tuple[int, str, torch.Tensor]], list[list[int]]]:
    """`members` (in backward order) laid out so each user group is contiguous, where its first member
    would be; and the groups as indices into that layout (a gradient in no group is one of its own)."""
    group_of = {key: g for g, keys in enumerate(groups) for key in keys}
    ordered: list[tuple[int, str, torch.Tensor]] = []
    layout: list[list[int]] = []
    placed: set[int] = set()
    for member in members:
        if member[0] in placed:
            continue
        g = group_of.get(member[0])
        batch = [member] if g is None else [m for m in members if group_of.get(m[0]) == g]
        layout.append(list(range(len(ordered), len(ordered) + len(batch))))
        ordered.extend(batch)
        placed.update(m[0] for m in batch)
    return ordered, layout
