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

The controller's state and how decisions consume it are worker/collective/negotiation_state.py's, the
way up (children's reports, the slow path, readiness, the next Up) negotiation_up.py's; here are the
inputs, the way down (applying the root's messages, the root's decisions) and stall alerts.
"""

from __future__ import annotations

from dataclasses import replace

from sluice.transport.wire import WireError
from sluice.worker.collective.negotiation_census import Census, bit_list
from sluice.worker.collective.negotiation_codec import MAX_OTHERS, Down, Up, check_down, check_up, pack_decisions
from sluice.worker.collective.negotiation_request import Request, check_request, signature
from sluice.worker.collective.negotiation_state import Decision
from sluice.worker.collective.negotiation_up import UpPath

__all__ = ["Controller", "Decision", "Down", "Request", "Up"]


class Controller(UpPath):
    """One rank's controller: `submit` and `receive` in, `tick` out, `take_decisions` what was decided."""

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

    def fast_index(self, name: str) -> int | None:
        """The table entry of this rank's pending request `name` if it went the fast path; else None."""
        index = self._index.get(name)
        return index if index is not None and name in self._own and self._own_bits >> index & 1 else None

    @property
    def epoch(self) -> int:
        """The join epoch: a new one begins each time every rank has joined."""
        return self._epoch

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

    # ------------------------------------------------------------------ the way down
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
