"""An aggregator's rounds: sum the children's pushes of a chunk, forward one push up, fan the reply down.

`Relay.handle` takes one validated wire message and the caller's `now`, and returns the messages to
send, like the shard store: no sockets, no clocks. A push from a child names its routing epoch and
tree (meta `route`); the tree says which workers' ranks reach this aggregator, so the round of that
chunk is complete here when pushes covering exactly those ranks are in (a child aggregator's push
lists its ranks). The sum is taken in rank order (ps/ranked_sum.py) and forwarded at once to the
parent: an aggregator of a higher level, or the server that owns the chunk. Each chunk travels
alone, so while chunk k's reply is fanned down, chunk k+1 is still being gathered: the tree is
pipelined chunk by chunk. Forwarded pushes and replies keep the children's priority and channel.
With ps.recover a forwarded push is kept until its reply, and sent again (RESEND) to a server that
replaced a dead one (`server_back`); with ps.replicas the pushes of the last ps.mirror_every
answered rounds are kept too (`kept`) and replayed first (scheduler/resend.py). A push of the round after one
forwarded, from a child a switch of trees moved here, waits for that round's reply (ps/relay_held.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.ps.ranked_sum import RankedSum, SparePool, f32_to_bf16
from sluice.ps.relay_held import Held
from sluice.ps.relay_replay import Replays
from sluice.ps.relay_tables import Tables, TreeView
from sluice.ps.store import Reply, push_ranks
from sluice.scheduler.leaving import left
from sluice.scheduler.resend import Answered, resent
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Flag, Kind, Message, WireError, brief, keep_payload


@dataclass
class _Child:
    peer: str
    channel: int
    round: int
    priority: int
    wants_value: bool
    #: the ranks it pushed for, and the push itself when it was sent again (RESEND), copied: passed up alone
    #: should its round turn out to be over upstream
    ranks: tuple[int, ...] = ()
    kept: Message | None = None


@dataclass
class _Round:
    round: int
    route: tuple[int, int]
    view: TreeView
    started: float
    pushed: set[int] = field(default_factory=set)
    children: list[_Child] = field(default_factory=list)
    opt: Any = None
    forwarded: bool = False
    #: the push forwarded up, until its reply (ps.recover: sent again to a server that replaced a dead one)
    sent: Message | None = None
    #: a child sent a push of it again (RESEND: this aggregator replaced a dead one): so is the sum forwarded
    resent: bool = False


@dataclass
class _Buffers:
    sum: RankedSum
    out: np.ndarray  # the sum in the storage dtype, for bfloat16 (else the sum's own array)
    reply: np.ndarray
    last_round: int = 0
    #: the optimizer settings last forwarded: a push sent again to a replaced server carries them
    opt: Any = None
    #: the channel the last push went up on (pushes sent again to a replaced server take it)
    channel: int = 0
    #: whether the last reply fanned down carried the value (in `reply`)
    replied_value: bool = False


def _opt(msg: Message) -> Any:
    """The optimizer settings a push carries (meta `opt`), or None."""
    return msg.meta.get("opt") if msg.meta else None


class Relay:
    def __init__(self, name: str, workers: int, alloc: Any = None) -> None:
        self.name, self.workers = name, workers
        self.node_id = -1
        self.tables = Tables(name)
        self._alloc = alloc or (lambda count, dtype: np.zeros(count, dtype))
        self._rounds: dict[tuple[int, int], _Round] = {}
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._spare = SparePool()
        self.departed: list[int] = []
        self.left_errors: dict[int, str] = {}  # a departed worker's error, when its goodbye said one
        #: ps.replicas: the pushes sent to servers in the last mirror_every answered rounds of each chunk
        self.kept: Answered | None = None
        #: pushes sent again of a round that was over upstream, passed up alone: (key, chunk, round) -> their
        #: parent and children, answered by the parent's reply of that round
        self._alone: dict[tuple[int, int, int], tuple[str, list[_Child]]] = {}
        #: rounds the children replay, summed again
        self.replays = Replays(self.tables, self._spare)
        #: pushes of the round after one forwarded and not yet answered, from children not in it, until its reply
        self._held = Held()

    # ------------------------------------------------------------------ messages
    def handle(self, peer: str, channel: int, msg: Message, now: float = 0.0) -> list[Reply]:
        """One peer's message at `now` (the caller's clock, seconds; only `stalled` reads it): the messages to send."""
        if msg.kind == Kind.PUSH:
            return self._push(peer, channel, msg, now)
        if msg.kind in (Kind.REPLY, Kind.ERROR):
            out = self._reply(peer, msg)
            return out + self._release((msg.key, msg.chunk), now) if self._held else out
        raise WireError(f"an aggregator does not take {msg.kind.name} messages")

    def _push(self, peer: str, channel: int, msg: Message, now: float) -> list[Reply]:
        tables = self.tables
        child = tables.sender(peer, msg.sender)
        route = tables.route_of(msg)
        view = tables.view(route)
        if child not in view.children:
            raise WireError(f"{peer} is not a child of {self.name} in tree {route[1]} of epoch {route[0]}")
        ranks = (tables.worker_ranks[child],) if child in tables.worker_ranks else push_ranks(msg, self.workers)
        length, dtype, _server = tables.chunk(msg.key, msg.chunk)
        if msg.payload is None or msg.dtype != dtype or msg.shape != (length,):
            raise WireError(f"key {msg.key} chunk {msg.chunk} holds {dtype}[{length}], the push carries "
                            f"{msg.dtype or 'nothing'}{list(msg.shape)}")
        at = (msg.key, msg.chunk)
        state = self._rounds.get(at)
        buffers = self._buffers.get(at)
        subtree_ok = set(ranks) <= set(view.ranks) and view.child_ranks.get(child, ranks) == ranks
        if msg.flags & Flag.REPLAY:
            if not subtree_ok:
                raise WireError(f"{peer} replayed ranks {brief(list(ranks))}, not its subtree in tree {route}")
            if state is None or state.round != msg.round or state.forwarded or state.route != route:
                return self.replays.take(self.node_id, channel, msg, ranks, view, route, self.kept)
            # the round in progress: its other children were not answered for it, and sent it again
            if not state.pushed.isdisjoint(ranks) or buffers is None:
                return []
            self._add(state, buffers, ranks, np.frombuffer(msg.payload, STORAGE[dtype]), _opt(msg), True)
            return [self._forward(msg, state, buffers)] if len(state.pushed) == len(view.ranks) else []
        again = self._sent_again(peer, channel, msg, state, buffers, ranks) \
            if msg.flags & Flag.RESEND and subtree_ok else None
        if again is not None:
            return again
        passed: list[Reply] = []
        if state is not None and subtree_ok and msg.round == state.round + 1 and not state.forwarded \
                and state.pushed.isdisjoint(ranks) and all(c.kept is not None for c in state.children):
            # a child past the round in progress: it had that round's reply from the aggregator this one
            # replaced, so the round is over upstream, and the others get its reply by their pushes alone
            passed = [self._pass_up(c, state.view, state.route) for c in state.children]
            self._drop(at, state)
            state = None
        if state is None:
            if buffers is not None and msg.round <= buffers.last_round:
                raise WireError(f"push for round {msg.round} of key {msg.key} chunk {msg.chunk}, which "
                                f"{self.name} has finished up to round {buffers.last_round}")
        elif subtree_ok and self._held.admits(at, state.round if state.forwarded else None, state.pushed, msg, ranks):
            self._held.hold(at, peer, channel, msg, ranks)
            return passed
        elif state.round != msg.round or state.route != route or state.forwarded:
            raise WireError(f"push for round {msg.round} (tree {route}) of key {msg.key} chunk {msg.chunk} while "
                            f"round {state.round} (tree {state.route}) is in progress")
        if (state is not None and not state.pushed.isdisjoint(ranks)) or not set(ranks) <= set(view.ranks):
            raise WireError(f"{peer} pushed ranks {brief(list(ranks))} of key {msg.key} chunk {msg.chunk} round "
                            f"{msg.round}: duplicated, or not below {self.name} in that tree")
        if child in view.child_ranks and ranks != view.child_ranks[child]:
            raise WireError(f"{peer} pushed ranks {list(ranks[:8])}: its subtree in tree {route[1]} of epoch "
                            f"{route[0]} holds ranks {list(view.child_ranks[child][:8])}")
        # valid: from here on the push is taken
        buffers = buffers or self._new_buffers(at, length, dtype)
        if state is None:
            state = self._rounds[at] = _Round(msg.round, route, view, now)
            buffers.sum.expect(view.ranks)
            for piece, data, opt in self.replays.claim(msg.key, msg.chunk, msg.round):  # replays of this round
                if set(piece).isdisjoint(ranks):
                    self._add(state, buffers, piece, data, opt, True)
        departed = [r for r in self.departed if r in view.ranks and r not in state.pushed]
        state.children.append(_Child(peer, channel, msg.round, msg.priority, bool(msg.flags & Flag.WANT_REPLY),
                                     ranks, keep_payload(msg) if msg.flags & Flag.RESEND else None))
        if departed:  # the round can never complete: say so now rather than at the deadline
            return passed + self._fail(at, state, f"round {msg.round} of key {msg.key} chunk {msg.chunk} can never "
                                         f"complete: {self._left(departed[0])}")
        self._add(state, buffers, ranks, np.frombuffer(msg.payload, STORAGE[dtype]), _opt(msg),
                  bool(msg.flags & Flag.RESEND))
        if len(state.pushed) < len(view.ranks):
            return passed
        return [*passed, self._forward(msg, state, buffers)]

    def _release(self, at: tuple[int, int], now: float) -> list[Reply]:
        """The pushes held at `at` once the round they waited for is over, each taken as it would have been then;
        one refused now is answered with an ERROR (its sender waits for an answer)."""
        state = self._rounds.get(at)
        out: list[Reply] = []
        for peer, channel, msg, _ranks in self._held.due(at, state.round if state is not None else None):
            try:
                out += self._push(peer, channel, msg, now)
            except WireError as exc:
                out += self._errors(at, [_Child(peer, channel, msg.round, msg.priority, False)],
                                    f"{self.name} refused the push: {exc}")
        return out

    def _add(self, state: _Round, buffers: _Buffers, ranks: tuple[int, ...], data: np.ndarray, opt: Any,
             resent: bool) -> None:
        """A piece covering `ranks` into the round's sum, with the optimizer settings it came with (or None)."""
        buffers.sum.take(ranks, data, self._spare)
        state.pushed.update(ranks)
        state.resent = state.resent or resent
        if opt is not None and state.opt is None:
            state.opt = opt  # the server checks it; every worker sends the same settings

    def _forward(self, msg: Message, state: _Round, buffers: _Buffers) -> Reply:
        """The complete sum of this subtree, one push up to the parent."""
        state.forwarded = True
        total = buffers.sum
        if total.dtype == "bfloat16":
            f32_to_bf16(total.accum, buffers.out)
        total.clear()
        meta: dict[str, Any] = {"ranks": list(state.view.ranks)}
        if state.view.parent_is_aggregator:
            meta["route"] = list(state.route)
        if state.opt is not None:
            meta["opt"] = buffers.opt = state.opt
        wants = any(c.wants_value for c in state.children)
        priority = min(c.priority for c in state.children)
        parent = self.tables.parent_peer(state.view, msg.key, msg.chunk)
        state.sent = Message(Kind.PUSH, sender=self.node_id, key=msg.key, chunk=msg.chunk, round=state.round,
                             priority=priority, dtype=msg.dtype, shape=buffers.out.shape, payload=buffers.out,
                             flags=(Flag.WANT_REPLY if wants else Flag.NONE) | (Flag.RESEND if state.resent else 0),
                             meta=meta)
        buffers.channel = state.children[0].channel
        return (parent, buffers.channel, state.sent)

    def _reply(self, peer: str, msg: Message) -> list[Reply]:
        at = (msg.key, msg.chunk)
        state = self._rounds.get(at)
        alone = self._alone.get((msg.key, msg.chunk, msg.round))
        if alone is not None and alone[0] == peer and (state is None or state.round != msg.round):
            del self._alone[msg.key, msg.chunk, msg.round]
            if msg.kind == Kind.ERROR:
                error = msg.meta.get("error") if msg.meta else None
                return self._errors(at, alone[1], error if isinstance(error, str) else "the parent refused the round")
            value = None
            if msg.payload is not None:  # copied: the transport reuses its buffer
                length, dtype, _server = self.tables.chunk(msg.key, msg.chunk)
                if msg.dtype != dtype or msg.shape != (length,):
                    raise WireError(f"reply for key {msg.key} chunk {msg.chunk} carries {msg.dtype}{list(msg.shape)}")
                value = np.frombuffer(bytes(msg.payload), STORAGE[dtype])
            return self._fan_out(msg, alone[1], value)
        if state is None or not state.forwarded or state.round != msg.round:
            raise WireError(f"{msg.kind.name} for key {msg.key} chunk {msg.chunk} round {msg.round}, which "
                            f"{self.name} did not forward")
        if peer != self.tables.parent_peer(state.view, msg.key, msg.chunk):
            raise WireError(f"{msg.kind.name} for key {msg.key} chunk {msg.chunk} from {peer}, not its parent")
        if msg.kind == Kind.ERROR:
            error = msg.meta.get("error") if msg.meta else None
            return self._fail(at, state, error if isinstance(error, str) else "the parent refused the round")
        buffers = self._buffers[at]
        if self.kept is not None and state.sent is not None and not state.view.parent_is_aggregator:
            self.kept.keep(self.tables.chunk(msg.key, msg.chunk)[2], state.sent)  # before the next round's sum
        if msg.payload is not None:
            if msg.dtype != self.tables.chunk(msg.key, msg.chunk)[1] or msg.shape != buffers.reply.shape:
                raise WireError(f"reply for key {msg.key} chunk {msg.chunk} carries {msg.dtype}{list(msg.shape)}")
            np.copyto(buffers.reply, np.frombuffer(msg.payload, buffers.reply.dtype))
        buffers.replied_value = msg.payload is not None
        del self._rounds[at]
        self.replays.answered(at, state.round)
        buffers.last_round = state.round
        return self._fan_out(msg, state.children, buffers.reply if msg.payload is not None else None)

    def _fan_out(self, msg: Message, children: list[_Child], value: Any) -> list[Reply]:
        """The parent's reply `msg`, to each child (with `value` to those that want it)."""
        out = []
        for child in children:
            given = value if child.wants_value else None
            out.append((child.peer, child.channel, Message(
                Kind.REPLY, sender=self.node_id, key=msg.key, chunk=msg.chunk, round=child.round,
                priority=child.priority, dtype=msg.dtype if given is not None else "",
                shape=given.shape if given is not None else (), payload=given)))
        return out

    def _sent_again(self, peer: str, channel: int, msg: Message, state: _Round | None, buffers: _Buffers | None,
                    ranks: tuple[int, ...]) -> list[Reply] | None:
        """A child's push sent again (RESEND) after this aggregator's or its parent's replacement: nothing when the
        first copy is in (its reply goes to the child's name), the reply again when the round ended here, the push
        passed up alone when its round is over upstream (another child pushed the next one: this aggregator
        replaced a dead one that had fanned the reply down to some children only), None when it is to be taken
        as any push."""
        if state is not None and state.round == msg.round and set(ranks) <= state.pushed:
            return []
        if buffers is not None and msg.round == buffers.last_round:
            value = buffers.reply if msg.flags & Flag.WANT_REPLY and buffers.replied_value else None
            return [(peer, channel, Message(
                Kind.REPLY, sender=self.node_id, key=msg.key, chunk=msg.chunk, round=msg.round, priority=msg.priority,
                dtype=msg.dtype if value is not None else "", shape=value.shape if value is not None else (),
                payload=value))]
        if state is not None and msg.round < state.round:
            return [self._pass_up(_Child(peer, channel, msg.round, msg.priority, bool(msg.flags & Flag.WANT_REPLY),
                                         ranks, keep_payload(msg)), state.view, state.route)]
        return None

    def _pass_up(self, child: _Child, view: TreeView, route: tuple[int, int]) -> Reply:
        """`child`'s push sent again, of a round over upstream, up alone (marked RESEND: the server answers it
        from its value, an aggregator above with the reply it fanned down): its reply goes to `child`."""
        kept = child.kept
        assert kept is not None
        meta: dict[str, Any] = {"ranks": list(child.ranks)}
        if view.parent_is_aggregator:
            meta["route"] = list(route)
        if kept.meta and "opt" in kept.meta:
            meta["opt"] = kept.meta["opt"]
        parent = self.tables.parent_peer(view, kept.key, kept.chunk)
        self._alone.setdefault((kept.key, kept.chunk, kept.round), (parent, []))[1].append(child)
        return (parent, child.channel, Message(
            Kind.PUSH, sender=self.node_id, key=kept.key, chunk=kept.chunk, round=kept.round, priority=kept.priority,
            dtype=kept.dtype, shape=kept.shape, payload=kept.payload,
            flags=(Flag.WANT_REPLY if child.wants_value else Flag.NONE) | Flag.RESEND, meta=meta))

    def _drop(self, at: tuple[int, int], state: _Round) -> _Buffers:
        """Forget the round in progress at `at`, and what its sum holds."""
        del self._rounds[at]
        buffers = self._buffers[at]
        buffers.sum.clear()
        for _, stashed in buffers.sum.stash.values():
            self._spare.give_back(stashed)
        buffers.sum.stash.clear()
        return buffers

    def _fail(self, at: tuple[int, int], state: _Round, error: str) -> list[Reply]:
        """End the round: every child that pushed hears `error`; later pushes of it are refused."""
        self._drop(at, state).last_round = state.round
        return self._errors(at, state.children, error)

    def _errors(self, at: tuple[int, int], children: list[_Child], error: str) -> list[Reply]:
        return [(c.peer, c.channel, Message(Kind.ERROR, sender=self.node_id, key=at[0], chunk=at[1], round=c.round,
                                            priority=c.priority, meta={"error": error}))
                for c in children]

    def _new_buffers(self, at: tuple[int, int], length: int, dtype: str) -> _Buffers:
        storage = np.dtype(STORAGE[dtype])
        wide = np.dtype(np.float32) if dtype == "bfloat16" else storage
        accum = self._alloc(length, wide)
        out = self._alloc(length, storage) if dtype == "bfloat16" else accum
        buffers = self._buffers[at] = _Buffers(RankedSum(accum, dtype), out, self._alloc(length, storage))
        return buffers

    # ------------------------------------------------------------------ job events
    def parent_back(self, parent: str) -> list[Reply]:
        """Aggregator `parent` replaced a dead one (ps.recover): every push forwarded to it and not answered,
        marked RESEND."""
        return [(parent, self._buffers[at].channel, resent(state.sent, self._buffers[at].opt))
                for at, state in self._rounds.items()
                if state.forwarded and state.sent is not None and state.view.parent_is_aggregator
                and state.view.parent == parent]

    def server_back(self, rank: int) -> list[Reply]:
        """Server `rank` replaced a dead one (ps.recover): the pushes of answered rounds kept for it (ps.replicas),
        oldest first, then every push forwarded to it and not answered, marked RESEND."""
        server = self.tables.server_names[rank]
        out: list[Reply] = [(server, buffers.channel if (buffers := self._buffers.get((m.key, m.chunk))) else
                             self.replays.channels.get((m.key, m.chunk), 0), m)
                            for m in (self.kept.replays(rank) if self.kept is not None else [])]
        for (key, chunk), state in self._rounds.items():
            if (state.forwarded and state.sent is not None and not state.view.parent_is_aggregator
                    and self.tables.chunk(key, chunk)[2] == rank):
                buffers = self._buffers[key, chunk]
                out.append((server, buffers.channel, resent(state.sent, buffers.opt)))
        return out

    def worker_left(self, rank: int, error: str = "") -> list[Reply]:
        """Worker `rank` said goodbye (`error`: the exception that ended it, if it said one): every round here
        still waiting for it fails now, naming it."""
        if type(rank) is not int or not 0 <= rank < self.workers:
            raise WireError(f"worker {brief(rank)} cannot leave: the job has workers 0..{self.workers - 1}")
        if rank not in self.departed:
            self.departed.append(rank)
            if error:
                self.left_errors[rank] = error
        out: list[Reply] = []
        for at, state in list(self._rounds.items()):
            if not state.forwarded and rank in state.view.ranks and rank not in state.pushed:
                out += self._fail(at, state, f"round {state.round} of key {at[0]} chunk {at[1]} can never "
                                             f"complete: {self._left(rank)}")
        return out

    def _left(self, rank: int) -> str:
        return left(f"worker {rank}", self.left_errors.get(rank, ""))

    def stalled(self, now: float, limit: float) -> list[str]:
        """Rounds in progress here for longer than `limit` seconds, naming whom they wait for."""
        lines = []
        for (key, chunk), state in self._rounds.items():
            if now - state.started > limit:
                what = ("its parent's reply" if state.forwarded
                        else f"workers {sorted(set(state.view.ranks) - state.pushed)}")
                lines.append(f"round {state.round} of key {key} chunk {chunk} has waited "
                             f"{now - state.started:.0f} s for {what}")
        return lines
