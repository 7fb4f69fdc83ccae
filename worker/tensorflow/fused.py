"""One set of gradients reduced each step as balanced fused groups: routed, prioritised, numpy only.

Built on the first step from the gradients' names, shapes and dtypes, the same on every rank. For
each route ("ps" or "allreduce", chosen as the PyTorch shim chooses: `choose_routes`) and dtype, the
gradients get slots in one registered buffer (worker/plan/fusion.py), in backward order (the reverse
of the variables' order, whose first layers are the most urgent: priority 0). Each step copies the
gradients into their slots (the one copy: TF tensors are immutable), sends every group at once,
most urgent first, through the collective engine's allreduce or the servers' push_pull, and writes
each averaged gradient into a fresh array (`reduce`, eager). Inside a tf.function the step is split
(`start` per group, `finish` once: worker/tensorflow/overlap.py), so that each group leaves as soon as
its gradients exist while the backward pass goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.errors import SluiceError
from sluice.transport.dtypes import STORAGE
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.reduce import scaled
from sluice.worker.config import WorkerConfig
from sluice.worker.group_route import GroupRoute
from sluice.worker.node import WorkerNode
from sluice.worker.plan.fusion import FusionPlan, group_layout, plan_fusion, unfused_plan
from sluice.worker.plan.priority import Assigned, describe, override_for, parse_overrides, priority_map, to_json

log = logging.getLogger("sluice.worker")


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # wire dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(STORAGE[self.dtype]).itemsize


def priorities(node: WorkerNode, settings: WorkerConfig, specs: Sequence[Spec]) -> list[Assigned]:
    """The priority of each gradient: its variable's place in the list (first layers first), all
    equal with worker.priority = none, worker.priority_overrides on top; rank 0 logs the map."""
    names = [s.name for s in specs]
    try:
        overrides = parse_overrides(settings.priority_overrides)
        if settings.priority == "none":
            assigned = [Assigned(n, 0, "none") if (o := override_for(n, overrides)) is None
                        else Assigned(n, o, "override") for n in names]
            how = "every tensor equal (worker.priority = none)"
        else:
            assigned, how = priority_map(names, None, overrides), "the order of the variables"
    except ValueError as exc:
        raise SluiceError(f"worker.priority_overrides: {exc}") from None
    if node.rank == 0:
        log.info("gradient priorities from %s (0 is the most urgent):", how)
        for line in describe(assigned, {s.name: s.nbytes for s in specs}):
            log.info("  %s", line)
        if settings.priority_file:
            Path(settings.priority_file).write_text(to_json(assigned) + "\n")
    return assigned


def choose_routes(node: WorkerNode, specs: Sequence[Spec]) -> dict[str, str]:
    """name -> "ps" or "allreduce", decided as the PyTorch shim decides (worker/torch/fusion.py)."""
    servers = node.hosts("server")
    if not servers:  # the common case needs no torch import: everything goes by allreduce
        return {s.name: "allreduce" for s in specs}
    from sluice.worker.torch.fusion import choose_routes as torch_routes

    sized: list[tuple[str, Any]] = [(s.name, _Bytes(s.nbytes)) for s in specs]
    return torch_routes(sized, node.collective_settings, node.hosts("worker"), servers)


@dataclass(frozen=True)
class _Bytes:
    """What choose_routes reads of a tensor: its size in bytes (as numel x element_size)."""

    nbytes: int

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


class _FusedSet:
    """The gradients of one route and dtype in one registered buffer, cut into the planned groups."""

    def __init__(self, node: WorkerNode, label: str, route: str, dtype: str, members: list[int],
                 specs: Sequence[Spec], priority: dict[str, int], engine: CollectiveEngine) -> None:
        self.node, self.route, self.dtype, self.members, self.engine = node, route, dtype, members, engine
        sizes = [specs[i].nbytes for i in members]
        settings = node.collective_settings
        greedy = route == "allreduce" and settings.fusion == "greedy"  # the engine fuses what a cycle decides
        fusion = settings.fusion_bytes
        self.plan: FusionPlan = plan_fusion(sizes, range(len(members)), fusion) if fusion and not greedy \
            else unfused_plan(sizes)
        self.item = np.dtype(STORAGE[dtype]).itemsize
        self.buffer = node.ps.alloc((self.plan.total_bytes // self.item,), dtype)
        self.slots = [(slot.offset // self.item, specs[members[slot.tensor]]) for slot in self.plan.slots]
        self.names = [f"{label}.{route}.{dtype}.{g.index}" for g in self.plan.groups]
        #: what each group holds, for its request: ranks whose gradients differ fail there, on every rank
        self.layouts = [group_layout(self.plan, g.index, [specs[i].shape for i in members], self.item)
                        for g in self.plan.groups]
        self.priorities = [min((priority[specs[members[t]].name] for t in g.tensors), default=0)
                           for g in self.plan.groups]
        # a process set's rounds on the servers count its workers only; the job's groups take the hierarchy
        self.sending = GroupRoute(node, route, None if engine is node.collectives else engine, self.names,
                                  [(g.end - g.start) // self.item for g in self.plan.groups], dtype, self.priorities,
                                  self.layouts, greedy)

    def load(self, arrays: Sequence[np.ndarray], prescale: float) -> None:
        for (offset, spec), index in zip(self.slots, self.members, strict=True):
            view = self.buffer[offset: offset + arrays[index].size]
            if prescale == 1.0:
                np.copyto(view, arrays[index].reshape(-1))
            else:
                scaled(arrays[index].reshape(-1), prescale, spec.dtype, view)

    def load_group(self, group: int, arrays: dict[int, np.ndarray], prescale: float) -> None:
        """The parts of `arrays` (by table index) that lie in the group's byte range, into the buffer."""
        g = self.plan.groups[group]
        first, last = g.start // self.item, g.end // self.item
        for t in g.tensors:
            offset, spec = self.slots[t]
            flat = arrays[self.members[t]].reshape(-1)
            lo, hi = max(offset, first), min(offset + flat.size, last)
            if hi <= lo:
                continue
            part, view = flat[lo - offset: hi - offset], self.buffer[lo:hi]
            if prescale == 1.0:
                np.copyto(view, part)
            else:
                scaled(part, prescale, spec.dtype, view)

    def send(self, group: int) -> Any:
        g = self.plan.groups[group]
        return self.sending.send(group, self.buffer[g.start // self.item: g.end // self.item])

    def unload(self, out: list[np.ndarray | None], scale: float) -> None:
        for (offset, spec), index in zip(self.slots, self.members, strict=True):
            view = self.buffer[offset: offset + int(np.prod(spec.shape, dtype=np.int64))]
            out[index] = (scaled(view, scale, spec.dtype) if scale != 1.0 else view.copy()).reshape(spec.shape)


class FusedReducer:
    """Sums (or averages) one fixed list of gradients over the workers, every step."""

    def __init__(self, node: WorkerNode, settings: WorkerConfig, specs: Sequence[Spec], label: str,
                 engine: CollectiveEngine) -> None:
        """`engine`: the process set's (or the job's) whose workers the gradients are summed over."""
        if len({s.name for s in specs}) != len(specs):
            raise SluiceError("gradient names must be unique")
        self.node, self.specs, self.size = node, list(specs), engine.size
        assigned = {a.name: a.priority for a in priorities(node, settings, specs)}
        routes = choose_routes(node, specs)
        if engine.set_id and node.by_rank("aggregator"):  # an aggregator sums its whole rack: a set takes allreduce
            routes = dict.fromkeys(routes, "allreduce")
        declared = {s.name: i for i, s in enumerate(specs)}
        backward = sorted(range(len(specs)), key=lambda i: (-assigned[specs[i].name], -declared[specs[i].name]))
        members: dict[tuple[str, str], list[int]] = {}
        for i in backward:
            members.setdefault((routes[specs[i].name], specs[i].dtype), []).append(i)
        self.sets = [_FusedSet(node, label, route, dtype, indices, specs, assigned, engine)
                     for (route, dtype), indices in sorted(members.items())]
        #: every group of every set, most urgent first (ties: backward order)
        self.order = sorted(((s.priorities[g], n, g) for n, s in enumerate(self.sets) for g in range(len(s.names))))
        #: (set, group) in the order backward completes them: the least urgent first
        self.ready_order = [(n, g) for _, n, g in sorted(((-p, n, g) for p, n, g in self.order))]
        self._pending: dict[tuple[int, int], Any] = {}  # the handles of the split step in flight
        self._pending_lock = threading.Lock()

    def reduce(self, arrays: Sequence[np.ndarray], average: bool, prescale: float = 1.0,
               postscale: float = 1.0) -> list[np.ndarray]:
        """The sum over the workers of each array times `prescale`, times `postscale` (and divided by
        the number of workers when `average`), each in a new array of its own shape."""
        if [(tuple(a.shape), a.dtype) for a in arrays] != [(s.shape, np.dtype(STORAGE[s.dtype])) for s in self.specs]:
            raise SluiceError("the gradients changed shape or dtype since the first step")
        self.node.step_times.tick(time.monotonic())  # a step's gradients: the Prometheus sluice_step_seconds
        for fused in self.sets:
            fused.load(arrays, prescale)
        handles = [self.sets[n].send(g) for _, n, g in self.order]
        for handle in handles:
            handle.wait()
        out: list[np.ndarray | None] = [None] * len(arrays)
        scale = postscale / self.size if average else postscale
        for fused in self.sets:
            fused.unload(out, scale)
        return [a for a in out if a is not None]

    # ------------------------------------------------------------------ the split step (traced: overlap.py)
    def inputs_of(self, fused: int, group: int) -> list[int]:
        """The indices (in the list of gradients) of the gradients that group `group` of set `fused` carries."""
        found = self.sets[fused]
        return [found.members[t] for t in found.plan.groups[group].tensors]

    def start(self, fused: int, group: int, arrays: dict[int, np.ndarray], prescale: float = 1.0) -> None:
        """Send one group now, its gradients (`arrays` by index, see inputs_of) copied in. The first
        group of a step first waits out what a failed step left in flight, so the names are free."""
        key = (fused, group)
        if key == self.ready_order[0]:
            self._drain()
            self.node.step_times.tick(time.monotonic())  # the step's first group: sluice_step_seconds
        found = self.sets[fused]
        found.load_group(group, arrays, prescale)
        handle = found.send(group)
        with self._pending_lock:
            self._pending[key] = handle

    def finish(self, average: bool, postscale: float = 1.0) -> list[np.ndarray]:
        """Wait for every group `start` sent, then each gradient's sum (times postscale, over the
        workers where `average`) in a new array; every group is waited for before an error is raised."""
        errors = self._drain()
        if errors:
            raise errors[0]
        out: list[np.ndarray | None] = [None] * len(self.specs)
        scale = postscale / self.size if average else postscale
        for fused in self.sets:
            fused.unload(out, scale)
        return [a for a in out if a is not None]

    def _drain(self) -> list[Exception]:
        with self._pending_lock:
            handles, self._pending = list(self._pending.values()), {}
        errors: list[Exception] = []
        for handle in handles:
            try:
                handle.wait()
            except Exception as exc:  # every group is waited for; the first failure is raised
                errors.append(exc)
        return errors
