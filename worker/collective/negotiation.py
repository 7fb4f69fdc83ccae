"""The coordinator tree's controller (pure): requests and messages in, messages and decisions out, no clocks.

One Controller per rank (seed 000: a controller on every node of a balanced tree; the root's decides).
Every rank holds the same operation order table, `table`, extended only by the root's messages. Per
edge, child and parent keep mirrored state: what the child has reported about its whole subtree, until
a decision consumes it on both sides (the parent applies a decision before forwarding it, so nothing
the child sends afterwards can be mistaken for what was consumed).

- Slow path (an op not in the table, or with a different description): the request waits at each node
  until its own rank and every child subtree have issued it, then goes up once as (request, lowest rank
  that submitted it). The root gives it a table index (a new one, or the old index of a changed op) and
  decides it; the decision carries the entry, so every rank extends its table identically.
- Fast path (an op in the table, same description): each node sends up the bits of table entries that
  became ready in its whole subtree (its own bits AND its children's) since its last message; the root
  decides the AND over all and sends down the bits of what it decided: no names, no shapes. An op
  decided is consumed everywhere, and may be submitted again (next iteration) under the same entry.
- Order: the root's decisions in one message are ordered by (priority, table index), and every rank
  applies the messages in the order they left the root, so `take_decisions` is the same list everywhere.
- Fan-in: a node sends at most one message up per `tick`, only when something changed, and none while
  its previous one is unacknowledged (the parent acknowledges at its next tick, `Down.ack`): a parent
  takes at most one message per child per tick, so the root at most `arity` per tick.
- Join: a joined rank counts as having issued every op, on either path; a subtree that has joined
  entirely says so once (`wild`) and is skipped from then on. Joins travel up (`joined`) no later than
  any readiness that depends on them; the root's messages carry them down, so every Decision has the
  same `joined` on every rank. When every rank has joined the root decides the join itself (index -1,
  request.root = the last rank to join) and every controller starts a new join epoch; messages from
  the previous epoch still on their way are dropped, and each child reports its state afresh.
- Mismatch (Horovod's semantics: the op fails on every rank, the job goes on): two descriptions of one
  name meeting at a node (slow against slow, or slow against a table entry some rank below is ready
  for) mark the name conflicted there, with a text naming a rank of each side. It waits, like any
  slow-path op, until every rank below has submitted it (in whatever description, or joined), then
  goes up as a conflict (`Up.conflicts`); the root decides it as failed (`Down.failed`), and every
  rank consumes the op (its own request, what its children reported, what it sent) and gets a
  Decision carrying the error, in the same place of the decision list. The table does not change.
  An op a rank submitted before it joined keeps that rank's description: a joined subtree still
  reports it up (slow path), and no node counts it ready on the fast path while a description of it,
  or a conflict, waits there.
- Stall: a rank whose own op has waited `stall_timeout` reports its name up (`stalled`); the root then
  runs a census (worker/collective/negotiation_census.py): a query down the tree, each node answering once its
  children have (or at a deadline), with which ranks below submitted the queried ops and what else
  waits. The root names, for each stalled op, the exact ranks that did not submit it (and the mismatch,
  if those that did disagree: no node may have seen both descriptions), unless the op was decided
  meanwhile; an op every rank submitted is no stall, even in descriptions that disagree (its failure
  is on its way up).
- Errors go up to the root and down from it, so every rank's `failure` ends up set; nothing is decided
  after it. Everything received is checked against this state first (WireError, and nothing changes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sluice.transport.wire import WireError
from sluice.worker.collective.negotiation_census import Census, bit_list, mismatch_text
from sluice.worker.collective.negotiation_codec import (
    MAX_OTHERS,
    MAX_TABLE,
    META_BUDGET,
    Answer,
    Down,
    Up,
    check_down,
    check_up,
    pack_decisions,
    up_size,
)
from sluice.worker.collective.negotiation_request import Request, check_request, describe, signature
from sluice.worker.collective.tree import Tree

__all__ = ["Controller", "Decision", "Down", "Request", "Up"]

#: distinct names the table holds; an op beyond it fails the job (name collectives the same every step)
DEFAULT_CAPACITY = 1 << 16


@dataclass(frozen=True)
class Decision:
    index: int  # position in the operation order table; -1 for the join
    request: Request
    joined: frozenset[int]  # ranks that had called join when this was decided (they contribute zeros)
    #: which of the root's decision messages decided it (the same count on every rank: greedy fusion
    #: fuses what one message decided, as Horovod fuses what one cycle found ready)
    batch: int = 0
    #: the op failed on every rank (its ranks disagree: index -2, request = this rank's own); None: run it
    error: str | None = None


class Controller:
    def __init__(self, rank: int, tree: Tree, stall_timeout: float, capacity: int = DEFAULT_CAPACITY) -> None:
        if not 0 <= rank < tree.size:
            raise ValueError(f"rank {rank} is not in a tree of {tree.size} ranks")
        if not 0 < capacity <= MAX_TABLE:
            raise ValueError(f"a table holds 1 to {MAX_TABLE} entries, not {capacity}")
        self.rank, self.size, self.stall_timeout, self.capacity = rank, tree.size, stall_timeout, capacity
        self.parent, self.children = tree.parent[rank], tree.children[rank]
        self.failure: str | None = None
        self.table: list[Request] = []
        self._index: dict[str, int] = {}
        self._below = {c: frozenset(tree.subtree(c)) for c in self.children}
        self._height = Tree(tree.parent, tree.children, rank).height()  # of this subtree
        # this rank's own pending requests; _own is in submit order, so its first keys are the oldest
        self._own_bits = 0
        self._own_new: dict[str, Request] = {}
        self._own: dict[str, tuple[Request, float]] = {}  # every pending request of this rank, submit time
        self._alerted: set[str] = set()
        self._joined_self = False
        # each child's reports (mirrored at the child), and the sequence numbers taken from it
        self._child_bits = dict.fromkeys(self.children, 0)
        self._child_new: dict[int, dict[str, tuple[Request, int]]] = {c: {} for c in self.children}
        self._child_wild = dict.fromkeys(self.children, False)
        self._child_conflict: dict[int, dict[str, str]] = {c: {} for c in self.children}
        # names whose descriptions disagree here or below (with the text), those every rank below has
        # submitted (to report up; at the root: to fail), and those reported up (mirrored at the parent)
        self._conflicts: dict[str, str] = {}
        self._complete_conflicts: dict[str, str] = {}
        self._sent_conflicts: set[str] = set()
        self._seq_in = dict.fromkeys(self.children, 0)
        self._ack_due: dict[int, int] = {}
        self._joined_below: dict[int, None] = {}  # ranks of this subtree that joined, this epoch, in order
        self._dirty: dict[str, None] = {}  # slow-path names to look at
        self._complete: dict[str, tuple[Request, int]] = {}  # complete below, not yet reported or decided
        # what this node has reported up (mirrored at the parent), and what it has still to report
        self._sent_bits, self._sent_new, self._sent_wild = 0, set[str](), False
        self._seq_out = self._acked = self._epoch = 0
        self._up_joined: list[int] = []
        self._up_stalled: dict[str, None] = {}
        self._stalled_sent: set[str] = set()
        self._up_answer: Answer | None = None
        self._up_error: str | None = None
        # the way down
        self._forward: list[Down] = []
        self._decisions: list[Decision] = []
        self._batches = 0  # decision messages applied (see Decision.batch)
        self._joined_view: list[int] = []
        self._census: Census | None = None
        # the root's own
        self._joined_unsent: list[int] = []
        self._suspects: dict[str, None] = {}
        self._queries = 0
        self._census_at: float | None = None
        self._error_sent = False

    # ------------------------------------------------------------------ inputs
    def submit(self, request: Request, now: float) -> None:
        """This rank's own request; ValueError for one no rank could run or one already pending here."""
        check_request(request, self.size)
        if self.failure is not None:
            return
        if request.kind == "join":
            if self._joined_self:
                raise ValueError(f"rank {self.rank} has already joined")
            self._joined_self = True
            self._note_joined(self.rank)
            self._dirty.update(dict.fromkeys(self._new_names()))
            return
        name = request.name
        if name in self._own:
            raise ValueError(f"collective {name!r} is already pending on rank {self.rank}")
        index = self._index.get(name)
        if index is not None and signature(self.table[index]) == signature(request):
            self._own_bits |= 1 << index
        else:
            self._own_new[name] = request
        if name in self._own_new or self._has_new(name):
            self._dirty[name] = None
        self._own[name] = (request, now)

    def receive(self, sender: int, message: Up | Down, now: float) -> None:
        """A message from a child (Up) or the parent (Down); WireError, changing nothing, if it does not fit."""
        if isinstance(message, Down):
            if sender != self.parent or self.parent is None:
                raise WireError(f"rank {self.rank}: a Down from rank {sender}, which is not its parent")
            check_down(message, f"rank {self.rank}: a Down from rank {sender}", self._seq_out, self.table,
                       self._index, self.capacity, self.size, set(self._joined_view),
                       None if self._joined_self else self._own)
            self._apply_down(message, now)
            self._forward.append(message)
        elif isinstance(message, Up):
            if sender not in self._seq_in:
                raise WireError(f"rank {self.rank}: an Up from rank {sender}, which is not its child")
            check_up(message, f"rank {self.rank}: rank {sender}'s message {message.seq}", self._seq_in[sender],
                     self._epoch, len(self.table), self._below[sender], self._joined_below,
                     self._child_new[sender].keys() | self._child_conflict[sender].keys())
            self._take_up(sender, message)
        else:
            raise WireError(f"rank {self.rank}: a {type(message).__name__} is no coordinator message")

    def tick(self, now: float) -> list[tuple[int, Up | Down]]:
        """(destination rank, message) to send now: at most one Up, and whatever goes down."""
        out: list[tuple[int, Up | Down]] = []
        if self.failure is None:
            self._own_alerts(now)
            self._scan_new()
            self._census_step(now)
        if self.parent is None:
            if self.failure is None:
                self._decide(now)
        else:
            up = self._compose_up()
            if up is not None:
                out.append((self.parent, up))
        for child in self.children:
            ack = self._ack_due.pop(child, 0)
            if self._forward:
                out += [(child, replace(d, ack=ack if k == 0 else 0)) for k, d in enumerate(self._forward)]
            elif ack:
                out.append((child, Down(ack=ack)))
        self._forward.clear()
        return out

    def take_decisions(self) -> list[Decision]:
        """Decisions since the last call, in the order every rank sees them."""
        taken, self._decisions = self._decisions, []
        return taken

    def deadline(self) -> float | None:
        """The next time a tick has something to do even if nothing arrives (a stall alert, a census)."""
        if self.failure is not None:
            return None
        due = [self._census.deadline] if self._census is not None else []
        if self._census_at is not None:
            due.append(self._census_at)
        oldest = next((since for name, (_, since) in self._own.items() if name not in self._alerted), None)
        if oldest is not None:
            due.append(oldest + self.stall_timeout)
        return min(due, default=None)

    # ------------------------------------------------------------------ applying
    def _take_up(self, child: int, up: Up) -> None:
        self._seq_in[child] = self._ack_due[child] = up.seq
        if up.error is not None:
            self._fail(up.error)
        if up.epoch == self._epoch and self.failure is None:
            fresh = up.ready & ~self._child_bits[child]
            self._child_bits[child] |= up.ready
            if fresh and self._new_names():
                self._dirty.update((self.table[i].name, None) for i in bit_list(fresh))
            for request, rep in up.new:
                self._child_new[child][request.name] = (request, rep)
                self._dirty[request.name] = None
            for rank in up.joined:
                self._note_joined(rank)
            if up.wild:
                self._child_wild[child] = True
                self._dirty.update(dict.fromkeys(self._new_names()))
            for name in up.stalled:
                self._alert(name)
            for name, text in up.conflicts:
                self._child_conflict[child][name] = text
                self._dirty[name] = None
        if up.answer is not None and self._census is not None:
            self._census.take(child, up.answer)

    def _apply_down(self, down: Down, now: float) -> None:
        if down.ack:
            self._acked = down.ack
        if down.error is not None:
            self._fail(down.error, from_parent=True)
        if self.failure is not None:
            return
        for index, request in down.entries:
            if index == len(self.table):
                self.table.append(request)
            self.table[index] = request
            self._index[request.name] = index
        self._joined_view += down.joined
        joined = frozenset(self._joined_view)
        for name, text in down.failed:  # before the decisions: every rank applies them in this order
            self._consume_failed(name, text, joined)
        decided = sorted(bit_list(down.decided), key=lambda i: (self.table[i].priority, i))
        self._batches += bool(decided)
        for index in decided:
            self._consume(index, self.table[index])
            self._decisions.append(Decision(index, self.table[index], joined, self._batches))
        if down.join_last >= 0:
            self._decisions.append(Decision(-1, Request("join", "join", root=down.join_last), joined))
            self._new_epoch()
        if down.query is not None:  # a node waits longer than its children: the one above names a silent one
            own = [request for request, _ in self._own.values()]
            self._census = Census.start(down.query, self.rank, self.children,
                                        now + self.stall_timeout * (1 + self._height), own)

    def _consume(self, index: int, decided: Request) -> None:
        mask, name = 1 << index, decided.name
        own = self._own_new.pop(name, None) if not self._own_bits & mask else None
        if self._own_bits & mask or own is not None:
            self._own_bits &= ~mask
            self._own.pop(name, None)
            self._alerted.discard(name)
        if own is not None and signature(own) != signature(decided):
            self._fail(f"collective {name!r} mismatch: rank {self.rank} submitted {describe(own)}, "
                       f"the other ranks {describe(decided)}")
        for child in self.children:
            self._child_bits[child] &= ~mask
            self._child_new[child].pop(name, None)
        self._sent_bits &= ~mask
        self._sent_new.discard(name)
        self._complete.pop(name, None)
        self._dirty.pop(name, None)
        self._suspects.pop(name, None)
        self._stalled_sent.discard(name)

    def _consume_failed(self, name: str, text: str, joined: frozenset[int]) -> None:
        """A conflicted op is over: forget it everywhere here; this rank's own request ends with `text`."""
        index = self._index.get(name)
        mask = 0 if index is None else 1 << index
        own = self._own.pop(name, None)
        self._own_new.pop(name, None)
        self._own_bits &= ~mask
        self._alerted.discard(name)
        for child in self.children:
            self._child_bits[child] &= ~mask
            self._child_new[child].pop(name, None)
            self._child_conflict[child].pop(name, None)
        self._sent_bits &= ~mask
        self._sent_new.discard(name)
        self._sent_conflicts.discard(name)
        for pending in (self._complete, self._complete_conflicts, self._conflicts, self._dirty, self._suspects):
            pending.pop(name, None)
        self._stalled_sent.discard(name)
        if own is not None:  # a rank that joined has none: it takes no part in a failed op
            self._decisions.append(Decision(-2, own[0], joined, self._batches, text))

    def _new_epoch(self) -> None:
        """Everyone has joined: forget joins and everything reported, and report this rank's state afresh."""
        self._epoch += 1
        self._joined_self, self._sent_wild = False, False
        self._joined_below.clear()
        self._joined_view.clear()
        self._joined_unsent.clear()
        self._up_joined.clear()
        for child in self.children:
            self._child_bits[child], self._child_wild[child] = 0, False
            self._child_new[child].clear()
            self._child_conflict[child].clear()
        self._conflicts.clear()
        self._complete_conflicts.clear()
        self._sent_conflicts.clear()
        self._sent_bits = 0
        self._sent_new.clear()
        self._complete.clear()
        self._dirty.update(dict.fromkeys(self._own_new))

    def _note_joined(self, rank: int) -> None:
        self._joined_below[rank] = None
        (self._joined_unsent if self.parent is None else self._up_joined).append(rank)

    def _alert(self, name: str) -> None:
        if self.parent is None:
            self._suspects[name] = None
        elif name not in self._stalled_sent:
            self._stalled_sent.add(name)
            self._up_stalled[name] = None

    def _fail(self, text: str, from_parent: bool = False) -> None:
        if self.failure is None:
            self.failure = text
            if self.parent is not None and not from_parent:
                self._up_error = text
        if self.parent is None and not self._error_sent:
            self._error_sent = True
            self._forward.append(Down(error=self.failure))

    # ------------------------------------------------------------------ the slow path and readiness
    def _new_names(self) -> set[str]:
        names = set(self._own_new) | set(self._conflicts)
        for child in self.children:
            names.update(self._child_new[child])
            names.update(self._child_conflict[child])
        return names

    def _has_new(self, name: str) -> bool:
        return name in self._own_new or name in self._conflicts or any(
            name in self._child_new[c] or name in self._child_conflict[c] for c in self.children)

    def _submitted_below(self, name: str, index: int | None) -> bool:
        """Has every rank of this subtree submitted `name`, in any description (or joined)?"""
        mask = 0 if index is None else 1 << index
        return (name in self._own_new or self._joined_self or bool(self._own_bits & mask)) and all(
            self._child_wild[c] or name in self._child_new[c] or name in self._child_conflict[c]
            or bool(self._child_bits[c] & mask) for c in self.children)

    def _wild(self) -> bool:
        return self._joined_self and all(self._child_wild.values())

    def _ready(self) -> int:
        mask = (1 << len(self.table)) - 1 if self._joined_self else self._own_bits
        for child, bits in self._child_bits.items():
            if not self._child_wild[child]:
                mask &= bits
        # a rank that submitted an op before it joined still has its own description of it: not ready
        # on the fast path while that (or a conflict) waits here, whatever a join says for the rest
        # (with no join here or in a child's report, the AND above has left such entries out already)
        joins = self._joined_self or any(self._child_wild.values())
        for name in self._new_names() if mask and joins else ():
            index = self._index.get(name)
            if index is not None:
                mask &= ~(1 << index)
        return mask

    def _scan_new(self) -> None:
        """Find slow-path names complete below (and mismatches among what is pending here)."""
        for name in self._dirty:
            if name in self._complete or name in self._sent_new or name in self._complete_conflicts or (
                    name in self._sent_conflicts):
                continue
            present: list[tuple[Request, int]] = []
            own = self._own_new.get(name)
            if own is not None:
                present.append((own, self.rank))
            present += [pending[name] for pending in self._child_new.values() if name in pending]
            reported = [pending[name] for pending in self._child_conflict.values() if name in pending]
            if not present and not reported:
                continue
            index = self._index.get(name)
            holders = list(present)
            if index is not None:
                if self._own_bits >> index & 1:
                    holders.append((self._own[name][0], self.rank))
                for child, bits in self._child_bits.items():
                    reps = self._below[child] - set(self._joined_below)
                    if bits >> index & 1 and reps:
                        holders.append((self.table[index], min(reps)))
            firsts: dict[tuple[object, ...], tuple[int, Request]] = {}
            for request, rep in sorted(holders, key=lambda h: h[1]):
                firsts.setdefault(signature(request), (rep, request))
            if len(firsts) > 1 and name not in self._conflicts:
                a, b = sorted(firsts.values(), key=lambda f: f[0])[:2]
                self._conflicts[name] = mismatch_text(name, a, b)
            elif reported and name not in self._conflicts:
                self._conflicts[name] = reported[0]
            if name in self._conflicts:
                if self._submitted_below(name, index):
                    self._complete_conflicts[name] = self._conflicts[name]
                continue
            if (own is not None or self._joined_self) and all(
                    self._child_wild[c] or name in self._child_new[c] for c in self.children):
                self._complete[name] = min(present, key=lambda p: p[1])
        self._dirty.clear()

    def _compose_up(self) -> Up | None:
        if self._seq_out != self._acked:
            return None  # the previous message is not acknowledged yet
        if self.failure is not None:
            if self._up_error is None:
                return None
            self._seq_out += 1
            up = Up(self._seq_out, self._epoch, error=self._up_error)
            self._up_error = None
            return up
        wild = self._wild() and not self._sent_wild
        ready = 0 if self._wild() else self._ready() & ~self._sent_bits
        new: list[tuple[Request, int]] = []
        budget = META_BUDGET
        for name, item in self._complete.items():
            if budget < up_size(item):  # even a joined subtree reports what it submitted before joining
                break
            budget -= up_size(item)
            new.append(item)
            self._sent_new.add(name)
        for request, _ in new:
            del self._complete[request.name]
        conflicts = tuple(self._complete_conflicts.items())[:MAX_OTHERS]
        for name, _ in conflicts:
            del self._complete_conflicts[name]
            self._sent_conflicts.add(name)
        stalled = tuple(self._up_stalled)[:MAX_OTHERS * 4]
        if not (wild or ready or new or conflicts or self._up_joined or stalled or self._up_answer
                or self._up_error):
            return None
        self._seq_out += 1
        self._sent_bits |= ready
        self._sent_wild |= wild
        up = Up(self._seq_out, self._epoch, ready, tuple(new), wild, tuple(self._up_joined), stalled,
                self._up_answer, self._up_error, conflicts)
        for name in stalled:
            del self._up_stalled[name]
        self._up_joined.clear()
        self._up_answer = self._up_error = None
        return up

    def _decide(self, now: float) -> None:
        """The root: decide what every rank is ready for, and send it down."""
        if self._wild():  # every rank has joined: the join itself is decided
            self._emit(Down(joined=tuple(self._joined_unsent), join_last=list(self._joined_below)[-1]), now)
            return
        if self._complete_conflicts:  # ops whose ranks disagree: failed on every rank, the job goes on
            failed = tuple(self._complete_conflicts.items())[:MAX_OTHERS]
            for name, _ in failed:
                del self._complete_conflicts[name]
            self._emit(Down(failed=failed), now)
        new = sorted(self._complete.values(), key=lambda item: item[0].priority)  # stable: completion order
        self._complete.clear()
        items: list[tuple[int, int, Request | None]] = []
        length = len(self.table)
        for request, _ in new:
            index = self._index.get(request.name)
            if index is None:
                index, length = length, length + 1
            items.append((request.priority, index, request))
        if length > self.capacity:
            self._fail(f"the collective operation table is full ({self.capacity} names): name collectives the "
                       f"same way every step (at {new[-1][0].name!r})")
            return
        items += [(self.table[i].priority, i, None) for i in bit_list(self._ready())]
        items.sort(key=lambda item: (item[0], item[1]))
        for down in pack_decisions([(i, r) for _, i, r in items], tuple(self._joined_unsent)):
            self._emit(down, now)
            self._joined_unsent.clear()  # they went down with the first (none go without a decision)
        if self._census is not None or not self._suspects or self.failure is not None:
            return
        if self._census_at is None:  # let the other ranks' alerts of this stall come in first
            self._census_at = now + min(self.stall_timeout / 2, 2.0)
        elif now >= self._census_at:
            self._queries += 1
            self._census_at = None
            self._emit(Down(query=(self._queries, tuple(sorted(self._suspects))[:MAX_OTHERS])), now)

    def _emit(self, down: Down, now: float) -> None:
        self._apply_down(down, now)
        self._forward.append(down)

    # ------------------------------------------------------------------ stalls
    def _own_alerts(self, now: float) -> None:
        for name, (_, since) in self._own.items():
            if since + self.stall_timeout > now:
                break  # submit order: the rest are younger
            if name not in self._alerted:
                self._alerted.add(name)
                self._alert(name)

    def _census_step(self, now: float) -> None:
        census = self._census
        if census is None or not census.done(now):
            return
        self._census = None
        if self.parent is not None:
            self._up_answer = census.answer()
            return
        error = census.verdict(self.size, self._joined_below, self._suspects, self.stall_timeout)
        if error is not None:
            self._fail(error)
        for name in census.names:
            self._suspects.pop(name, None)
