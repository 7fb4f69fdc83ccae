"""Pipeline-parallel schedules and stage splits (pure): what each stage runs, in what order, and when.

A model cut into P stages runs M micro-batches a step. Each stage runs its own list of actions
(`F m`: the forward of micro-batch m, `B m`: its backward; `I m` and `W m`: that backward split into
the inputs' gradient and the weights') in order; `replay` runs those lists against their dependencies
(a forward needs the stage before it, a backward or an I the stage after it, a W its I) at given
times, on as many cores as wanted (bench/pipeline.py replays measured compute), and `clock_table`
shows from it which micro-batch each stage runs at each clock, as torchgpipe's `clock_cycles` tables do.
GPipe (fill-drain) runs every forward, then every backward: each stage holds the activations of all M
micro-batches. 1F1B (PipeDream-flush, as Megatron and torch.distributed.pipelining run it) warms up
with P - 1 - s forwards at stage s, then alternates one forward and one backward: stage s holds at
most P - s micro-batches' activations. Both leave (P - 1) / (M + P - 1) of each stage idle when a
forward and a backward take the same time. The interleaved and zero-bubble orders (V chunks of the
model per worker, each action naming its virtual stage) are in interleave.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble")
#: the schedules whose backward is split into I (inputs' gradient) and W (weights' gradient)
SPLIT_BACKWARD = frozenset(("interleavedzerobubble",))


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" (a whole backward), "I" (its inputs' gradient) or "W" (its weights')
    micro: int
    #: the virtual stage (chunk c of worker r is c * P + r) where a worker holds several chunks, else None
    stage: int | None = None

    def __str__(self) -> str:
        """`F0`, or with a virtual stage `2F0` (as torch.distributed.pipelining writes its actions)."""
        return f"{'' if self.stage is None else self.stage}{self.kind}{self.micro}"


def _check(stages: int, micro: int) -> None:
    if stages < 1 or micro < 1:
        raise ValueError(f"a pipeline needs at least one stage and one micro-batch, got {stages} and {micro}")


def gpipe(stages: int, micro: int) -> list[list[Action]]:
    """Every forward, then every backward (in micro-batch order), on every stage."""
    _check(stages, micro)
    order = [Action("F", m) for m in range(micro)] + [Action("B", m) for m in range(micro)]
    return [list(order) for _ in range(stages)]


def one_f_one_b(stages: int, micro: int) -> list[list[Action]]:
    """Warm-up forwards (P - 1 - s at stage s), then one forward and one backward in turn, then the
    backwards left."""
    _check(stages, micro)
    orders = []
    for stage in range(stages):
        warmup = min(stages - 1 - stage, micro)
        order = [Action("F", m) for m in range(warmup)]
        for m in range(warmup, micro):
            order += [Action("F", m), Action("B", m - warmup)]
        order += [Action("B", m) for m in range(micro - warmup, micro)]
        orders.append(order)
    return orders


def canonical(name: str) -> str:
    """The schedule's name as SCHEDULES spells it: case does not matter, and torch's class names
    (`ScheduleInterleaved1F1B`, `Interleaved1F1B`) name theirs. ValueError for any other."""
    key = name.lower().replace("-", "").replace("_", "")
    key = key.removeprefix("schedule") if key != "schedule" else key
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)} (or torch's "
                         "class names: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, "
                         "ScheduleInterleavedZeroBubble)")
    return key


def schedule(name: str, stages: int, micro: int, virtual: int = 1) -> list[list[Action]]:
    """Each worker's order for schedule `name` (see `canonical`), with `virtual` chunks per worker."""
    from sluice.worker.pipeline import interleave  # it builds on Action

    key = canonical(name)
    if key in ("gpipe", "1f1b") and virtual != 1:
        raise ValueError(f"{key} runs one chunk of the model per stage, not {virtual}: take interleaved1f1b or "
                         "interleavedzerobubble for several")
    if key == "gpipe":
        return gpipe(stages, micro)
    if key == "1f1b":
        return one_f_one_b(stages, micro)
    if key == "interleaved1f1b":
        return interleave.interleaved_1f1b(stages, micro, virtual)
    return interleave.interleaved_zero_bubble(stages, micro, virtual)


def inputs_first(orders: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """The orders with each whole backward (B) of a (virtual) stage that has one before it run as its I,
    then at once its W: the inputs' gradient leaves for the stage before as soon as it exists instead of
    after the weights' (which that stage never needs). The same micro-batches in the same order, the same
    activations held; the step shortens by a W on each hop of the backward's critical path."""
    return [[part for action in order
             for part in ((Action("I", action.micro, action.stage), Action("W", action.micro, action.stage))
                          if action.kind == "B" and (rank if action.stage is None else action.stage) > 0
                          else (action,))]
            for rank, order in enumerate(orders)]


def replay(orders: Sequence[Sequence[Action]], duration: Callable[[Action, int], float],
           cores: int | None = None) -> list[tuple[int, Action, float, float]]:
    """Each action as (worker, action, start, end), the orders run against their dependencies (a forward
    needs the stage before it, a backward or an I the stage after it, a W its I), taking
    `duration(action, virtual stage)`: the action that can start first goes next, once its worker is
    free, its inputs are there and one of `cores` processors is free (by default one per worker, so
    every action starts as soon as it can). With virtual stages (actions naming theirs), stage k runs
    on worker k % P and the chain runs through all of them. Raises ValueError if the orders deadlock."""
    stages = len(orders)
    named = [a.stage for order in orders for a in order if a.stage is not None]
    last = max(named) if named else stages - 1
    # (what, micro, virtual stage) -> when it finished; "G": the inputs' gradient (a B or an I)
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * stages
    free_at = [0.0] * stages
    core_free = [0.0] * (cores or stages)
    runs: list[tuple[int, Action, float, float]] = []
    while any(position[s] < len(orders[s]) for s in range(stages)):
        best: tuple[float, int] | None = None
        for rank in range(stages):
            if position[rank] == len(orders[rank]):
                continue
            needs = _needs(orders[rank][position[rank]], rank, last)
            if all(need in done for need in needs):
                ready = max([free_at[rank], *(done[need] for need in needs)])
                best = (ready, rank) if best is None or ready < best[0] else best
        if best is None:
            raise ValueError("these stage orders deadlock: an action waits for one that waits for it")
        ready, rank = best
        action = orders[rank][position[rank]]
        stage = rank if action.stage is None else action.stage
        core = min(range(len(core_free)), key=core_free.__getitem__)
        start = max(ready, core_free[core])
        end = start + duration(action, stage)
        runs.append((rank, action, start, end))
        done[("F" if action.kind == "F" else "G" if action.kind in "BI" else "W", action.micro, stage)] = end
        free_at[rank] = core_free[core] = end
        position[rank] += 1
    return runs


def _needs(action: Action, rank: int, last: int) -> list[tuple[str, int, int]]:
    """What `action` (on worker `rank`) waits for: (what, micro, virtual stage) as `replay` records them."""
    stage = rank if action.stage is None else action.stage
    if action.kind == "F":
        return [("F", action.micro, stage - 1)] if stage > 0 else []
    if action.kind == "W":
        return [("G", action.micro, stage)]
    return [("F", action.micro, stage)] + ([("G", action.micro, stage + 1)] if stage < last else [])


def clock_table(orders: Sequence[Sequence[Action]], forward: int = 1, backward: int = 1, input_grad: int = 1,
                weight_grad: int = 1) -> list[list[str]]:
    """Which action each stage runs at each clock ("" when idle), a forward taking `forward` clocks, a
    backward `backward`, an I `input_grad` and a W `weight_grad`: row t, column s (the worker), from
    `replay`. Raises ValueError if the orders deadlock."""
    length = {"F": forward, "B": backward, "I": input_grad, "W": weight_grad}
    runs = replay(orders, lambda action, _: length[action.kind])
    table = [[""] * len(orders) for _ in range(int(max((end for *_, end in runs), default=0)))]
    for rank, action, start, end in runs:
        for clock in range(int(start), int(end)):
            table[clock][rank] = str(action)
    return table


def peak_activations(order: Sequence[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once (forward done, its B or W not), all
    its chunks together."""
    held = peak = 0
    for action in order:
        held += {"F": 1, "B": -1, "W": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


def bubble(stages: int, micro: int) -> float:
    """The idle fraction of each stage when forward and backward take equal time: (P - 1) / (M + P - 1)."""
    _check(stages, micro)
    return (stages - 1) / (micro + stages - 1)


def idle_fraction(table: Sequence[Sequence[str]], stage: int) -> float:
    """How much of the step stage `stage` spent idle, from a clock table."""
    return sum(1 for row in table if not row[stage]) / len(table) if table else 0.0


def balanced_split(costs: Sequence[float], parts: int) -> list[int]:
    """Where to cut a sequence of layers with `costs` into `parts` contiguous stages so that the most
    expensive stage costs least: the index of each stage's first layer (the first is 0). Ties go to
    the earliest cut. Exact: the bound is the smallest sum of consecutive costs that a greedy cut
    fits in `parts` stages (binary search over those sums)."""
    if not 1 <= parts <= len(costs):
        raise ValueError(f"cannot cut {len(costs)} layers into {parts} stages: each stage needs a layer")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs cannot be negative")

    def cuts_for(bound: float) -> list[int] | None:
        starts, total = [0], 0.0
        for index, cost in enumerate(costs):
            if cost > bound:
                return None
            if total + cost > bound:
                starts.append(index)
                total = 0.0
            total += cost
        return starts if len(starts) <= parts else None

    candidates = sorted({sum(costs[i:j]) for i in range(len(costs)) for j in range(i + 1, len(costs) + 1)})
    low, high = 0, len(candidates) - 1
    while low < high:  # the smallest candidate bound that fits in `parts` stages
        middle = (low + high) // 2
        if cuts_for(candidates[middle]) is not None:
            high = middle
        else:
            low = middle + 1
    starts = cuts_for(candidates[low])
    assert starts is not None
    # fewer stages than asked: split the largest stages further (single layers stay whole)
    while len(starts) < parts:
        bounds = [*starts, len(costs)]
        sizes = [(sum(costs[bounds[i]:bounds[i + 1]]), i) for i in range(len(starts)) if bounds[i + 1] - bounds[i] > 1]
        _, widest = max(sizes)
        starts.insert(widest + 1, bounds[widest + 1] - 1)
    return starts
