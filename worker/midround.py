"""A worker's side of a switch inside a round: its pushes of rounds in flight taken back at ROUTES, sent at COMMIT.

At ROUTES (scheduler/hierarchy/switch.py) the worker takes back from its transport the pushes of its
rounds in flight that have not begun to leave, and lists them in its answer, each with the trees it
takes now and the tree it would take in the announced ones. The COMMIT's `moved` names the chunks
whose pushes take the new trees after all, and whose (whole groups of workers:
scheduler/hierarchy/midround.py); this worker's go there, the rest where they were going. Between the
two the pushes wait here, as the rounds started meanwhile wait in the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sluice.scheduler.hierarchy.midround import MAX_HELD, Moved
from sluice.transport.base import Transport
from sluice.transport.wire import Flag, Kind, Message
from sluice.worker.routing import Router

#: a push taken back: the peer and channel it was queued for, and the push
Queued = tuple[str, int, Message]


class HeldBack:
    def __init__(self, transport: Transport, name: str) -> None:
        self._transport, self._name = transport, name
        self.pushes: list[Queued] = []

    def take(self, router: Router, rounds: set[tuple[int, int]]) -> list[list[int]]:
        """ROUTES (the I/O thread, under the client's lock): take back the queued pushes of `rounds` ((key,
        round), tensors the router routes); all held back so far, as [key, round, chunk, epoch, tree,
        announced tree] (the same trees told again, by a standby, list them again). Before the job's first trees
        nothing is taken back: those rounds move nowhere (scheduler/hierarchy/midround.py plan_moves)."""
        if router.epoch == 0:
            return []

        def picked(peer: str, channel: int, msg: Message) -> bool:  # a push sent again (recovery) keeps its way
            return (msg.kind == Kind.PUSH and not msg.flags & (Flag.RESEND | Flag.REPLAY)
                    and (msg.key, msg.round) in rounds and router.knows(msg.key, msg.chunk))

        self.pushes += self._transport.withdraw(picked)
        if len(self.pushes) > MAX_HELD:  # more than an answer may list: none moves, all go where they were going
            return []
        held = []
        for _, _, msg in self.pushes:
            epoch, tree = router.tree_of(msg.key, msg.chunk, msg.round)
            held.append([msg.key, msg.round, msg.chunk, epoch, tree, router.announced_tree(msg.key, msg.chunk)])
        return held

    def release(self, router: Router, moved: Sequence[Moved],
                server_name: Callable[[int], str]) -> tuple[list[Queued], list[tuple[Message, str | None]]]:
        """COMMIT (under the client's lock, once the router took the new trees): every push held back, with
        where it goes (the new trees for the chunks `moved` lists this worker under, else where it was going),
        and those moved, each with its new parent aggregator (None: straight to its server)."""
        mine = {(key, round_, chunk) for key, round_, chunk, workers in moved if self._name in workers}
        out, self.pushes = self.pushes, []
        onto: list[tuple[Message, str | None]] = []
        for index, (peer, channel, msg) in enumerate(out):
            if (msg.key, msg.round, msg.chunk) not in mine:
                continue
            meta = {k: v for k, v in (msg.meta or {}).items() if k != "route"}
            route = router.moved(msg.key, msg.chunk)
            if route is None:  # straight to the chunk's server in the new trees
                peer = server_name(router.server_of(msg.key, msg.chunk))
            else:
                meta["route"], peer = [route[0], route[1]], route[2]
            msg.meta = meta or None
            out[index] = (peer, channel, msg)
            onto.append((msg, None if route is None else peer))
        return out, onto
