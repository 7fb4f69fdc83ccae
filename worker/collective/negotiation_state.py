"""The coordinator tree controller's state (pure): what each edge has reported, and how decisions consume it.

A ControllerState holds this rank's own pending requests, each child's reports about its whole
subtree (mirrored at the child) and what waits to go up or down; here a decided op is consumed
everywhere, a failed (mismatched) op forgotten, a new join epoch begun, and joins, stall alerts and
the job's error noted. The way up is negotiation_up.py's, the Controller (inputs, the way down,
stalls) negotiation.py's, in worker/collective/. No sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.worker.collective.negotiation_census import Census
from sluice.worker.collective.negotiation_codec import MAX_TABLE, Answer, Down
from sluice.worker.collective.negotiation_request import Request, describe, signature
from sluice.worker.collective.tree import Tree

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
    #: the op's result, when its data came up the tree with the requests (worker/collective/carry.py)
    result: Any = field(default=None, compare=False)


class ControllerState:
    """One rank's controller state (see worker/collective/negotiation.py for the protocol)."""

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
    # ------------------------------------------------------------------ consuming
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
