"""The coordinator tree's executor: a Controller (negotiation.py) ticked by its callers or its own thread.

Messages arrive on the transport's I/O thread (`on_message`): their sender must be this rank's parent or
a child, and their format is checked there (refused through `transport.refuse` otherwise); what passes is
queued. A tick takes what is queued to the Controller, one tick at a time, and at most one more than the
node has neighbours within any `cycle_ms` (tick_budget.py): each neighbour's news, and this rank's own
request, can be taken at once once a cycle, so the message that completes an op's round at the root (the last
child's request) waits for no timer, while a burst of requests still goes up batched. With the
Controller's one-unacknowledged-message-per-edge rule a node sends at most one message to each
neighbour per tick, and takes at most one per child. A tick that is due at once (news within the
cycle's budget: a step's request, the decision coming down) runs in the thread that brought it, a
submit's caller or the I/O thread, so that no thread is woken for it (measured on 4 workers of the demo
model on 2 cores: 16 voluntary context switches a step on a worker instead of 22); the coordinator thread
runs the ticks a cycle holds back and those the Controller's deadlines call for (a stall alert, a
census). Everything goes on channel 0 with priority 0 (control is the most urgent traffic), or, to a neighbour
on this host, over a direct lane (coord_lanes.py: its own thread reads it and ticks inline). Decisions
are handed to `on_decided` in order, by the thread that ticked; a failure to `on_error`, once.

Connections (see collective.tree.dials): each pair of neighbours is dialled once, by the higher rank. Each
rank sends a hello to the neighbours it dialled, so that they learn a route back; what it has for a
neighbour that dialled it waits until that neighbour has been heard from (at most `stall_timeout`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sluice.transport import lane as lanes
from sluice.transport.base import Transport
from sluice.transport.rejects import Rejections
from sluice.transport.wire import Kind, Message, WireError, encode
from sluice.worker.collective.carry import Carrier, check_blobs
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.coord_lanes import CoordinatorLanes
from sluice.worker.collective.negotiation import Controller, Decision, Down, Request, Up
from sluice.worker.collective.negotiation_codec import decode_down, decode_up, encode_down, encode_up, hello, is_hello
from sluice.worker.collective.negotiation_request import check_request
from sluice.worker.collective.tick_budget import TickBudget
from sluice.worker.collective.tree import Tree, dials

log = logging.getLogger("sluice.coordinator")

#: messages kept for a neighbour not heard from yet; more means it never came (the job fails)
MAX_HELD = 10_000
#: the coordinator thread looks at the Controller's deadlines (stall alerts, a census: seconds away) at least this
#: often, so that a tick a caller ran needs no wake-up to tell it of a new one
IDLE_CHECK_S = 0.25

#: a request with the data it carries (carry.py; None: the data plane moves it)
_Submitted = tuple[Request, Any]
#: a tick's work: when it began, the messages and requests it takes, the neighbours heard from
_Turn = tuple[float, list[tuple[int, Up | Down, int]], list[_Submitted], set[int]]


def message_bytes(msg: Message) -> int:
    """Bytes a message takes on the wire: its header as encoded, plus its payload."""
    return len(encode(msg)[0]) + msg.nbytes


class Coordinator:
    def __init__(self, transport: Transport, rank: int, tree: Tree, peers: Sequence[str], settings: CollectiveConfig,
                 on_decided: Callable[[Decision], None], on_error: Callable[[str], None], node_id: int = -1,
                 on_cycle_end: Callable[[], None] = lambda: None, local: Collection[int] = ()) -> None:
        """`on_cycle_end` is called after each cycle's decisions have been handed to `on_decided`. `local`: ranks on
        this host; messages to those of them that are neighbours go over direct lanes (coord_lanes.py)."""
        if len(peers) != tree.size:
            raise ValueError(f"{len(peers)} peer names for a tree of {tree.size} ranks")
        self.rank, self.tree = rank, tree
        self._transport, self._peers, self._node_id = transport, list(peers), node_id
        self._on_decided, self._on_error, self._on_cycle_end = on_decided, on_error, on_cycle_end
        self._cycle = settings.cycle_ms / 1e3
        self._stall = settings.stall_timeout
        self._controller = Controller(rank, tree, settings.stall_timeout)
        self._carrier = Carrier(tree.children[rank], tree.size, settings.carry_bytes)
        self._parent = tree.parent[rank]
        self._rank_of = {peers[r]: r for r in tree.neighbours(rank)}
        self._cond = threading.Condition()
        self._inbox: list[tuple[int, Up | Down, int]] = []
        self._submitted: list[_Submitted] = []
        self._pending: set[str] = set()  # names submitted here and not decided yet
        self._heard = {r for r in tree.neighbours(rank) if dials(rank, r)}  # we dialled these: routes known
        self._held: dict[int, list[Message]] = {}
        self._held_since: dict[int, float] = {}
        self._batch_since: float | None = None  # first submit or Up since the last tick
        self._urgent = False  # a Down came: forward it as soon as a cycle allows
        self._counts = dict.fromkeys(("messages_received", "bytes_received", "messages_sent", "bytes_sent",
                                      "max_received_per_tick", "ticks", "refused", "decisions", "held",
                                      "received_on_lanes"), 0)
        self._rejects = Rejections(log)
        self._failed = False
        self._closed = False
        self._ticking = False  # a tick runs (on the coordinator thread or a caller's): one at a time
        #: ticks a cycle may hold (see the module's docstring)
        self._budget = TickBudget(1 + len(tree.neighbours(rank)), self._cycle)
        for r in sorted(self._heard):
            kind = Kind.COORD_UP if r == self._parent else Kind.COORD_DOWN
            transport.send(peers[r], 0, hello(kind, node_id))
        near = set(local) & set(self._rank_of.values())
        pairs = {r: (peers[r], Kind.COORD_UP if r == self._parent else Kind.COORD_DOWN) for r in near}
        self._lanes = CoordinatorLanes(transport, rank, node_id, pairs, {r for r in near if dials(rank, r)},
                                       self._arrived) if near and lanes.AVAILABLE else None
        if self._lanes is not None:
            self._lanes.start()
        self._thread = threading.Thread(target=self._run, name=f"sluice-coordinator-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers (any thread)
    def submit(self, request: Request, data: Any = None) -> None:
        """Queue this rank's request; ValueError for a malformed one or a name already pending here. `data`: an
        allreduce's (flat, contiguous, left as it is until decided), to carry up with the request if it may."""
        check_request(request, self.tree.size)
        key = "\0join" if request.kind == "join" else request.name
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the coordinator of rank {self.rank} is closed")
            if key in self._pending:
                raise ValueError(f"rank {self.rank}: {'join' if request.kind == 'join' else repr(request.name)}"
                                 " is already pending")
            self._pending.add(key)
            now = time.monotonic()
            self._submitted.append((request, data))
            self._batch_since = now if self._batch_since is None else self._batch_since
            turn = self._claim(now)
            if turn is None:
                self._cond.notify()
        if turn is not None:
            self._take_turn(turn)

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Counters since the start (or the last reset): messages and bytes (header + payload) each way,
        the most controller messages taken in one tick, ticks, refused messages, decisions (`carried`: those
        whose result came with them), held messages, messages received over direct lanes."""
        with self._cond:
            taken = dict(self._counts)
            taken["carried"] = self._carrier.carried
            if reset:
                self._counts = dict.fromkeys(self._counts, 0)
        return taken

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        if self._lanes is not None:
            self._lanes.close()

    # ------------------------------------------------------------------ transport I/O thread
    def on_message(self, peer: str, msg: Message) -> None:
        """Check and queue a COORD_UP (from a child) or COORD_DOWN (from the parent); refuse anything else."""
        sender = self._rank_of.get(peer)
        if sender is None or msg.kind != (Kind.COORD_DOWN if sender == self._parent else Kind.COORD_UP):
            self._transport.refuse(peer, f"coordinator of rank {self.rank}: a {msg.kind.name} from {peer!r:.60}, "
                                         "which is not what its parent or a child of it sends")
        elif self._lanes is not None and sender in self._lanes:
            if why := self._lanes.arrive(sender, msg, on_lane=False):
                self._transport.refuse(peer, f"coordinator of rank {self.rank}: {msg.kind.name} from {peer!r:.60}: "
                                             f"{why}")
        else:
            self._arrived(sender, msg, False)

    def _arrived(self, sender: int, msg: Message, on_lane: bool) -> None:
        """A message of the kind `sender` sends, in its order (on the I/O thread, or the lanes' thread)."""
        peer = self._peers[sender]
        try:
            parsed = None if is_hello(msg) else decode_up(msg) if msg.kind == Kind.COORD_UP else decode_down(msg)
        except WireError as exc:
            text = f"coordinator of rank {self.rank}: {msg.kind.name} from {peer!r:.60}: {exc}"
            if self._lanes is not None and self._lanes.on_own_thread():
                self._lanes.rejects.refuse(peer, text, time.monotonic())
            else:
                self._transport.refuse(peer, text)
            return
        size = message_bytes(msg)
        with self._cond:
            if self._closed:
                return
            self._counts["messages_received"] += 1
            self._counts["received_on_lanes"] += on_lane
            self._counts["bytes_received"] += size
            self._heard.add(sender)
            if parsed is not None:
                self._inbox.append((sender, parsed, size))
                if isinstance(parsed, Down):
                    self._urgent = True
                elif self._batch_since is None:
                    self._batch_since = time.monotonic()
            turn = self._claim(time.monotonic())
            if turn is None:
                self._cond.notify()
        if turn is not None:
            self._take_turn(turn)

    # ------------------------------------------------------------------ coordinator thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    turn = self._wait()
                    if turn is None:
                        return
                self._take_turn(turn, caught=False)
        except Exception as exc:  # a bug here must not leave the job waiting forever: fail it, loudly
            log.exception("coordinator of rank %d failed", self.rank)
            self._fail(f"the coordinator of rank {self.rank} failed: {type(exc).__name__}: {exc}")
        finally:
            with self._cond:
                self._closed = True  # nothing is queued any more
                self._inbox.clear()

    def _ready_at(self) -> float | None:
        """When the next tick is due (under the lock), within the tick budget; None while there is nothing to do."""
        free = self._budget.free_at()
        if self._urgent or self._heard & set(self._held) or self._batch_since is not None:
            # news within the cycle's budget goes at once: a step's last fusion group, and the last child's
            # request at the root, wait for no timer (the rest of a burst waits a cycle)
            return free
        due = [d for d in (self._controller.deadline(), *(t + self._stall for t in self._held_since.values()))
               if d is not None]
        return max(min(due), free) if due else None

    def _claim(self, now: float) -> _Turn | None:
        """This tick's work, taken (under the lock) if a tick is due at `now` and none runs; else None."""
        if self._closed or self._ticking:
            return None
        ready_at = self._ready_at()
        if ready_at is None or now < ready_at:
            return None
        self._ticking = True
        self._budget.took(now)
        inbox, self._inbox = self._inbox, []
        self._batch_since, self._urgent = None, False
        submitted, self._submitted = self._submitted, []
        return now, inbox, submitted, set(self._heard)

    def _wait(self) -> _Turn | None:
        """On the coordinator thread: until a tick is due and no caller runs one, then its work; None once
        closed. Callers run a tick that is due at once themselves (`submit`, `on_message`: no thread to wake);
        this thread takes the rest, and the deadlines, which it looks at again at least every IDLE_CHECK_S."""
        while not self._closed:
            now = time.monotonic()
            turn = self._claim(now)
            if turn is not None:
                return turn
            ready_at = None if self._ticking else self._ready_at()
            wait = IDLE_CHECK_S if ready_at is None else min(max(ready_at - now, 0.0), IDLE_CHECK_S)
            self._cond.wait(wait)
        return None

    def _take_turn(self, turn: _Turn, caught: bool = True) -> None:
        """Run a claimed tick, then let the next one be claimed (by the coordinator thread, or a caller)."""
        try:
            self._tick(*turn)
        except Exception as exc:
            if not caught:
                raise
            log.exception("coordinator of rank %d failed", self.rank)  # a bug: fail the job, loudly
            self._fail(f"the coordinator of rank {self.rank} failed: {type(exc).__name__}: {exc}")
        finally:
            with self._cond:
                self._ticking = False
                if self._inbox or self._submitted:  # arrived while this tick ran: due a cycle after it
                    self._cond.notify()

    def _tick(self, now: float, inbox: list[tuple[int, Up | Down, int]], submitted: list[_Submitted],
              heard: set[int]) -> None:
        controller, carrier = self._controller, self._carrier
        for request, data in submitted:
            try:
                controller.submit(request, now)
            except ValueError as exc:  # submit() checked it already; a disagreement is a bug, and ends the job
                self._fail(f"rank {self.rank}: {exc}")
                continue
            carrier.own(controller.fast_index(request.name), request, data)
        for sender, message, _ in inbox:
            try:
                check_blobs(message, controller.table, f"rank {sender}'s message")
                controller.receive(sender, message, now)
            except WireError as exc:  # a message that does not fit this rank's state: dropped, nothing changed
                self._rejects.refuse(self._peers[sender], f"coordinator of rank {self.rank}: {exc}", now)
                with self._cond:
                    self._counts["refused"] += 1
                continue
            if isinstance(message, Up):
                carrier.take_up(sender, message, controller.epoch)
            else:
                carrier.take_down(message, controller.table)
        out, decisions = carrier.attach(controller.tick(now), controller.take_decisions(), controller.table,
                                        root=self._parent is None)
        sent = 0
        for dest, message in out:
            msg = encode_up(message, self._node_id) if isinstance(message, Up) else encode_down(message,
                                                                                                self._node_id)
            if dest in heard and dest not in self._held:
                self._send(dest, msg)
                sent += message_bytes(msg)
            else:
                self._hold(dest, msg, now)
        with self._cond:
            for dest in heard & set(self._held):  # a neighbour that dialled us has spoken: its route is known
                for msg in self._held.pop(dest):
                    self._send(dest, msg)
                    sent += message_bytes(msg)
                del self._held_since[dest]
            late = [dest for dest, since in self._held_since.items() if now - since > self._stall]
            for dest in late:
                del self._held[dest], self._held_since[dest]
            c = self._counts
            c["held"] = sum(map(len, self._held.values()))
            c["ticks"] += 1
            c["max_received_per_tick"] = max(c["max_received_per_tick"], len(inbox))
            c["messages_sent"] += len(out)
            c["bytes_sent"] += sent
            c["decisions"] += len(decisions)
            for decision in decisions:
                self._pending.discard("\0join" if decision.request.kind == "join" else decision.request.name)
        for decision in decisions:
            try:
                self._on_decided(decision)
            except Exception as exc:
                log.exception("coordinator of rank %d: on_decided failed", self.rank)
                self._fail(f"handling the decision of {decision.request.name!r} failed on rank {self.rank}: "
                           f"{type(exc).__name__}: {exc}")
        if decisions:
            self._on_cycle_end()
        for dest in late:
            self._fail(f"the coordinator of rank {self.rank} never heard from rank {dest} ({self._peers[dest]}), "
                       f"its {'parent' if dest == self._parent else 'child'}, in {self._stall:g} s")
        if controller.failure is not None:
            self._fail(controller.failure)
        self._rejects.tick(now)

    def _send(self, dest: int, msg: Message) -> None:
        if self._lanes is not None and dest in self._lanes:
            self._lanes.send(dest, msg)
        else:
            self._transport.send(self._peers[dest], 0, msg)

    def _hold(self, dest: int, msg: Message, now: float) -> None:
        with self._cond:
            held = self._held.setdefault(dest, [])
            self._held_since.setdefault(dest, now)
            if len(held) < MAX_HELD:  # past that the neighbour is surely gone; it fails the job at the deadline
                held.append(msg)

    def _fail(self, text: str) -> None:
        if not self._failed:
            self._failed = True
            try:
                self._on_error(text)
            except Exception:
                log.exception("coordinator of rank %d: on_error failed", self.rank)
