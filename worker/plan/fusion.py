"""Balanced tensor fusion (pure): gradients laid out in one flat buffer, cut into equal groups, sent as they fill.

Horovod fuses whatever a 5 ms cycle happens to find ready, so buffer sizes swing from one tiny tensor
to the full threshold, and change from run to run (horovod #1548). Here the grouping is planned once,
offline, from the gradients' sizes and the order backward produces them (seed 004):

- Every gradient of one dtype gets a slot in one flat buffer, in backward order, each slot aligned.
  The buffer is what the gradients are views of (DDP's gradient_as_bucket_view), so a fused group is
  sent with no copy.
- The buffer is cut into k = ceil(total / buffer_bytes) byte ranges of equal size (aligned): groups
  balanced by construction (max/mean = 1 up to the alignment), each within the fusion buffer size.
  A gradient may straddle two groups; both then wait for it. Since slots follow backward order, a
  group's gradients are produced one after another: no group waits for one produced much later.
- Online (`OnlineFusion`), each cycle's newly ready gradients complete some groups, which are sent
  now, most urgent first; the rest stay on the defer list for the next cycle (the seed's two lists).
  `finish` flushes what is left when backward ends (a parameter that got no gradient this step),
  so nothing waits past the step.

The same sizes and order give the same groups every step and every run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: slot and group boundaries fall on this many bytes (a cache line; every dtype's item size divides it)
ALIGN = 64


def _align(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Slot:
    """Where one gradient lies in the flat buffer."""

    tensor: int  # index in the caller's table
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Group:
    """A byte range of the flat buffer, sent as one fused message, and the gradients it needs."""

    index: int
    start: int
    end: int
    tensors: tuple[int, ...]  # the table indices of the gradients overlapping [start, end)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FusionPlan:
    slots: tuple[Slot, ...]  # in backward order
    groups: tuple[Group, ...]
    total_bytes: int  # the flat buffer's size

    def balance(self) -> float:
        """max/mean group size (1.0 is perfect)."""
        sizes = [g.nbytes for g in self.groups]
        return max(sizes) / (sum(sizes) / len(sizes)) if sizes else 1.0


def plan_fusion(sizes: Sequence[int], order: Sequence[int], buffer_bytes: int, align: int = ALIGN) -> FusionPlan:
    """Groups for gradients of `sizes` bytes (one dtype), produced by backward in `order` (table
    indices, first produced first), with a fusion buffer of `buffer_bytes`."""
    if sorted(order) != list(range(len(sizes))):
        raise ValueError("order must list every tensor index exactly once")
    if buffer_bytes < align or any(n < 0 for n in sizes):
        raise ValueError(f"buffer_bytes must be at least {align} and sizes non-negative")
    buffer_bytes -= buffer_bytes % align  # so that aligned groups stay within it
    slots, offset = [], 0
    for tensor in order:
        slots.append(Slot(tensor, offset, sizes[tensor]))
        offset += _align(sizes[tensor], align)
    total = offset
    count = max(1, math.ceil(total / buffer_bytes))
    step = _align(math.ceil(total / count), align) if total else 0
    bounds = [min(i * step, total) for i in range(count)] + [total]
    groups: list[Group] = []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end <= start and index:  # alignment left nothing for the last ones
            continue
        members = tuple(s.tensor for s in slots if _overlaps(s, start, end, total))
        groups.append(Group(len(groups), start, end, members))
    return FusionPlan(tuple(slots), tuple(groups), total)


def unfused_plan(sizes: Sequence[int], align: int = ALIGN) -> FusionPlan:
    """Every gradient its own group (collective.fusion_bytes = 0), slots laid out as plan_fusion lays
    them out for `order` = the table's order."""
    slots, groups, offset = [], [], 0
    for index, size in enumerate(sizes):
        slots.append(Slot(index, offset, size))
        groups.append(Group(index, offset, offset + size, (index,)))
        offset += _align(size, align)
    return FusionPlan(tuple(slots), tuple(groups), offset)


def grouped_plan(sizes: Sequence[int], groups: Sequence[Sequence[int]], align: int = ALIGN) -> FusionPlan:
    """The user's own groups (Horovod's `groups=[[...], ...]`): each listed group of table indices is one
    fused message; slots are laid out group after group, in the order given. Every tensor must be in
    exactly one group (a tensor on its own is a group of one)."""
    if sorted(i for g in groups for i in g) != list(range(len(sizes))) or any(not g for g in groups):
        raise ValueError("groups must be non-empty and list every tensor index exactly once")
    slots, planned, offset = [], [], 0
    for index, members in enumerate(groups):
        start = offset
        for tensor in members:
            slots.append(Slot(tensor, offset, sizes[tensor]))
            offset += _align(sizes[tensor], align)
        planned.append(Group(index, start, offset, tuple(members)))
    return FusionPlan(tuple(slots), tuple(planned), offset)


def _overlaps(slot: Slot, start: int, end: int, total: int) -> bool:
    """Does the slot share a byte with [start, end)? An empty one counts where it lies (at the very
    end: in the last group), so every gradient belongs to some group."""
    first = min(slot.offset, max(total - 1, 0))
    return first < end and max(slot.offset + slot.nbytes, first + 1) > start


def group_layout(plan: FusionPlan, index: int, shapes: Sequence[tuple[int, ...]], item: int) -> tuple[
        tuple[int, ...], ...]:
    """What group `index` of the flat buffer holds, in elements of `item` bytes, as a collective's request
    describes it: each gradient wholly in it by its shape (`shapes`, by table index), a part of one, or
    the padding between, by its length. Ranks whose gradients differ then differ here, and the request
    fails on every rank, where the buffers' lengths alone might agree."""
    group = plan.groups[index]
    layout: list[tuple[int, ...]] = []
    at = group.start
    for slot in sorted((plan.slots[i] for i in _slots_of(plan, group)), key=lambda s: s.offset):
        low, high = max(slot.offset, group.start), min(slot.offset + slot.nbytes, group.end)
        if high <= low:
            continue
        if low > at:
            layout.append(((low - at) // item,))
        whole = (low, high) == (slot.offset, slot.offset + slot.nbytes)
        layout.append(tuple(shapes[slot.tensor]) if whole else ((high - low) // item,))
        at = high
    if group.end > at:
        layout.append(((group.end - at) // item,))
    return tuple(layout)


def _slots_of(plan: FusionPlan, group: Group) -> list[int]:
    """The indices in plan.slots of the gradients of `group`."""
    return [i for i, slot in enumerate(plan.slots) if slot.tensor in group.tensors]


@dataclass
class OnlineFusion:
    """One step's online split: gradients become ready, complete groups go out, the rest is deferred."""

    plan: FusionPlan
    ready: set[int] = field(default_factory=set)
    sent: set[int] = field(default_factory=set)
    #: groups with some but not all of their gradients ready, carried into the next cycle
    deferred: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # per gradient, the groups it lies in; per group, how many of its gradients are still missing:
        # a cycle costs what its gradients touch, not a walk over every group (200 hooks a step)
        self._groups_of: dict[int, list[int]] = {}
        for group in self.plan.groups:
            for tensor in group.tensors:
                self._groups_of.setdefault(tensor, []).append(group.index)
        self._missing = [len(g.tensors) for g in self.plan.groups]

    def cycle(self, newly_ready: Iterable[int]) -> list[Group]:
        """Take this cycle's ready gradients; the groups to send now, in backward order."""
        done: list[int] = []
        for tensor in newly_ready:
            if tensor in self.ready:
                continue
            self.ready.add(tensor)
            for index in self._groups_of.get(tensor, ()):
                self._missing[index] -= 1
                if not self._missing[index] and index not in self.sent:
                    done.append(index)
        self.sent.update(done)
        groups = self.plan.groups
        self.deferred = [g.index for g in groups
                         if g.index not in self.sent and self._missing[g.index] < len(g.tensors)]
        return [groups[index] for index in sorted(done)]

    def finish(self) -> list[Group]:
        """Backward is over: every group not yet sent goes now (missing gradients count as zeros)."""
        rest = [g for g in self.plan.groups if g.index not in self.sent]
        self.sent.update(g.index for g in rest)
        self.deferred = []
        return rest

    def next_step(self) -> None:
        self.ready.clear()
        self.sent.clear()
        self.deferred = []
        self._missing = [len(g.tensors) for g in self.plan.groups]
