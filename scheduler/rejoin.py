"""What a node keeps of the scheduler's answers, so that a standby scheduler can rebuild the job from the nodes.

A standby (scheduler.standby) holds no copy of the scheduler's state: when the scheduler falls silent,
every node sends it a REJOIN saying who it is and what it was told (scheduler/standby.py), and the
standby replays that. What is told is small and already on every node: its id, rank and endpoints;
for a worker, each declaration it saw planned (in the scheduler's planning order, with the key the
servers know it by, and the tensors it declared), the job's limits, the workers the scheduler said
had left, the barriers released lately; for a worker or an aggregator, the last switch of aggregation
trees it was told of (ROUTES, the rounds a worker answered, the COMMIT: a standby finishes a switch the
scheduler left open, scheduler/hierarchy/switch.py); and the requests still waiting for an answer, sent
again once the standby has taken over. Rebuilding from the nodes costs nothing while the scheduler lives,
where replicating its state would add a round trip to every declaration and barrier.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.transport.wire import Kind, Message, WireError, brief

#: barrier names a node remembers as released (a standby releases a barrier some worker saw released)
RELEASED_KEPT = 64


@dataclass
class Recall:
    """One node's memory of the scheduler's answers; the caller holds its lock around every call."""

    #: planned declarations: [order, key, seq, ranks or None, tensors as declared]
    declarations: list[list[Any]] = field(default_factory=list)
    #: the job's [chunk bytes, in-flight bytes], as the last PLAN settled them
    limits: list[int] | None = None
    #: workers the scheduler said left the job (BYE with their rank)
    gone: set[int] = field(default_factory=set)
    released: deque[str] = field(default_factory=lambda: deque(maxlen=RELEASED_KEPT))
    #: requests not answered yet, by the key their answer is filed under: (kind, meta) to send again
    pending: dict[Hashable, tuple[Kind, dict[str, Any]]] = field(default_factory=dict)
    #: the last ROUTES' routing, as sent (scheduler/hierarchy/routes.py), the rounds this node answered it
    #: with, and the last COMMIT's [epoch, rounds]
    routes: Any = None
    routes_acked: Any = None
    committed: Any = None
    #: the job's generation, as the WELCOME said (a standby of a later one refuses this node's REJOIN)
    generation: int = 0

    def asked(self, key: Hashable, kind: Kind, meta: dict[str, Any]) -> None:
        self.pending[key] = (kind, meta)

    def answered(self, key: Hashable) -> None:
        self.pending.pop(key, None)

    def planned(self, plan: Message, seq: int, ranks: Sequence[int] | None, tensors: list[Any]) -> None:
        """A PLAN answered this worker's DECLARE: remember it in the scheduler's order (a PLAN without
        one is not replayed: a standby plans it again when it is declared again)."""
        meta = plan.meta or {}
        order, key, limits = meta.get("order"), meta.get("key", seq), meta.get("limits")
        if order is None:
            return
        if type(order) is not int or type(key) is not int:
            raise WireError(f"a PLAN's order and key must be ints, got {brief(order)} and {brief(key)}")
        self.declarations.append([order, key, seq, list(ranks) if ranks is not None else None, tensors])
        if type(limits) is list:
            self.limits = list(limits)

    def on_message(self, msg: Message) -> None:
        """What the scheduler's other messages tell: a worker gone, a barrier released."""
        meta = msg.meta or {}
        if msg.kind == Kind.BYE and type(meta.get("rank")) is int:
            self.gone.add(meta["rank"])
        elif msg.kind == Kind.RELEASE and type(meta.get("name")) is str:
            self.released.append(meta["name"])
        elif msg.kind == Kind.ROUTES:
            self.routes, self.routes_acked = meta.get("routes"), None
        elif msg.kind == Kind.COMMIT:
            self.committed = [meta.get("epoch"), meta.get("rounds"), meta.get("moved", [])]

    def sent(self, kind: Kind, meta: dict[str, Any]) -> None:
        """What this node told the scheduler that a standby needs: its answer to the last ROUTES."""
        if kind == Kind.ROUTES_ACK:
            self.routes_acked = meta.get("rounds", [])

    def rejoin_meta(self, role: str, rank: int, node_id: int, endpoints: Sequence[str], pid: int,
                    fingerprint: str, job: str) -> dict[str, Any]:
        """`job`: the endpoint of the scheduler the node registered with, which names the job in the registries."""
        return {"role": role, "rank": rank, "node_id": node_id, "endpoints": list(endpoints), "pid": pid,
                "fingerprint": fingerprint, "job": job, "generation": self.generation,
                "declarations": self.declarations, "limits": self.limits,
                "gone": sorted(self.gone), "released": list(self.released),
                "routing": {"routes": self.routes, "acked": self.routes_acked, "committed": self.committed}}
