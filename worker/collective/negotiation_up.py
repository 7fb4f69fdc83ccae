"""The coordinator tree's way up (pure): children's reports taken, slow-path and fast-path readiness, the next Up.

A node takes each child's Up into the mirrored state (worker/collective/negotiation_state.py), finds
the slow-path names complete below and the mismatches among them, ANDs the fast-path bits, and
composes at most one Up per tick, none while the previous one is unacknowledged. No sockets, no clocks.
"""

from __future__ import annotations

from sluice.worker.collective.negotiation_census import bit_list, mismatch_text
from sluice.worker.collective.negotiation_codec import MAX_OTHERS, META_BUDGET, Up, up_size
from sluice.worker.collective.negotiation_request import Request, signature
from sluice.worker.collective.negotiation_state import ControllerState


class UpPath(ControllerState):
    """What a node reports to its parent, and what it takes from its children."""

    # ------------------------------------------------------------------ taking a child's report
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

