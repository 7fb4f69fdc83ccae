"""The stall census of the coordinator tree (pure): who below submitted the ops some rank has waited on too long.

A rank whose own op has waited `stall_timeout` tells the root (worker/collective/negotiation.py); the root waits a
little for the other ranks' alerts of the same stall (min(stall_timeout / 2, 2 s)), then sends a query
down naming the suspect ops, in name order. Each node starts a Census with its own rank's pending
requests, merges its children's answers, and answers up once every child has (or at its deadline: a
node waits longer than its children, so a silent subtree is named by the node above it). The root's
`verdict` turns the union into the job's error: for every queried op, the exact ranks that did not
submit it (joined ranks count as having submitted everything), and the other ops waiting; an op some
ranks submitted in descriptions that disagree is named as a mismatch too (what it stalls on is still the
missing ranks: once every rank submits it, it fails on every rank and the job goes on). An op every rank
submitted is no stall, whatever its descriptions: its decision (or failure) is on its way. So the text
does not depend on which alert came first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sluice.worker.collective.negotiation_codec import MAX_OTHERS, Answer
from sluice.worker.collective.negotiation_request import Request, describe, ranks_text, signature


def mismatch_text(name: str, a: tuple[int, Request], b: tuple[int, Request]) -> str:
    """The error for two descriptions of one op, each with a rank that submitted it."""
    (ra, qa), (rb, qb) = sorted((a, b), key=lambda x: x[0])
    return f"collective {name!r} mismatch: rank {ra} submitted {describe(qa)}, rank {rb} submitted {describe(qb)}"


def bit_list(mask: int) -> list[int]:
    """The positions of the set bits of `mask`, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


@dataclass
class Census:
    query: int
    names: tuple[str, ...]  # the ops asked about
    waiting: set[int]  # children that have not answered
    deadline: float
    #: per (name, signature): a request as submitted, and the bitmap of the ranks below that submitted it
    found: dict[tuple[object, ...], tuple[Request, int]] = field(default_factory=dict)
    others: dict[str, None] = field(default_factory=dict)  # other ops pending below (at most MAX_OTHERS)
    more: int = 0
    silent: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, query: tuple[int, tuple[str, ...]], rank: int, children: Iterable[int], deadline: float,
              own: Iterable[Request]) -> Census:
        """A node's census, with its own rank's pending requests `own` already counted."""
        census = cls(query[0], query[1], set(children), deadline)
        for request in own:
            if request.name in census.names:
                census._add(request, 1 << rank)
            else:
                census._other(request.name)
        return census

    def take(self, child: int, answer: Answer) -> None:
        """A child's answer (ignored unless it answers this query and the child has not answered yet)."""
        if answer.query != self.query or child not in self.waiting:
            return
        self.waiting.discard(child)
        for request, bits in answer.found:
            self._add(request, bits)
        for name in answer.others:
            self._other(name)
        self.more += answer.more
        self.silent += answer.silent

    def done(self, now: float) -> bool:
        """Every child answered, or the deadline passed (the rest are then silent)."""
        if self.waiting and now < self.deadline:
            return False
        self.silent += sorted(self.waiting)
        self.waiting.clear()
        return True

    def answer(self) -> Answer:
        return Answer(self.query, tuple(self.found.values())[:MAX_OTHERS * 4], tuple(self.others), self.more,
                      tuple(self.silent))

    def verdict(self, size: int, joined: Iterable[int], suspects: Iterable[str], stall_timeout: float) -> str | None:
        """At the root, once done: the job's error for the queried ops still suspect, or None: every op
        some rank did not submit, ops missing the same ranks named together, then the mismatches among them."""
        joined, suspects = set(joined), set(suspects)
        stalled: dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]] = {}
        mismatches: list[str] = []
        for name in self.names:
            if name not in suspects:
                continue  # decided while the census ran
            groups = sorted(((bits & -bits).bit_length() - 1, request, bits)
                            for (n, _), (request, bits) in self.found.items() if n == name)
            did = 0
            for _, _, bits in groups:
                did |= bits
            missing = tuple(r for r in range(size) if not did >> r & 1 and r not in joined)
            if missing:
                stalled.setdefault((missing, tuple(bit_list(did))), []).append(name)
                if len(groups) > 1:
                    mismatches.append(mismatch_text(name, groups[0][:2], groups[1][:2]))
        if not stalled:
            return None
        clauses = [f"{ranks_text(list(missing))} did not submit {', '.join(map(repr, names))}"
                   + (f" ({ranks_text(list(did))} did)" if did else "") for (missing, did), names in stalled.items()]
        text = f"collective stalled for {stall_timeout:g} s: {'; '.join(clauses + mismatches)}"
        named = {name for names in stalled.values() for name in names}
        waiting = [n for n in (*self.names, *self.others) if n not in named]
        if waiting or self.more:
            text += f"; also waiting: {', '.join(map(repr, waiting))}" + (f" and {self.more} more" if self.more else "")
        if joined:
            text += f"; {ranks_text(sorted(joined))} joined"
        if self.silent:
            text += f"; no census answer from the subtrees of {ranks_text(self.silent)}"
        return text

    def _add(self, request: Request, bitmap: int) -> None:
        key = (request.name, signature(request))
        known = self.found.get(key)
        self.found[key] = (request if known is None else known[0], bitmap | (0 if known is None else known[1]))

    def _other(self, name: str) -> None:
        if name not in self.names and name not in self.others:
            if len(self.others) < MAX_OTHERS:
                self.others[name] = None
            else:
                self.more += 1
