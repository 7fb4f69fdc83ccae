"""Small allreduces carried by the coordinator tree (pure): data up with the requests, results down with decisions.

An allreduce already in the operation table (the fast path) and of at most `collective.carry_bytes`
sends its data with its request: each node adds its children's subtree sums to its own, in a fixed
order (its own, then its children's in tree order), and sends the sum up with the bit that says its
subtree is ready; the root reduces its own with its children's, divides an average, and sends the
result down with the decision. Every rank then has the result when it learns of the decision: two hops
of the tree instead of four (request up, decision down, data up, result down), and no sequence number.

The root attaches a result only when every rank's data is in it: a node sends a sum only when it has
its own data and every child's for that entry, so a joined rank (no data), a child whose message had no
room, or a rank that sent the op by the slow path leaves the op to the data plane on every rank, in the
same place. What a node holds for an entry is dropped as it reports the entry up and as the entry is
decided or fails (its round is over); everything at a join (a new epoch). No sockets, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from sluice.transport.wire import WireError
from sluice.worker.collective.negotiation_census import bit_list
from sluice.worker.collective.negotiation_codec import Down, Up
from sluice.worker.collective.negotiation_request import Request, data_op
from sluice.worker.collective.negotiation_state import Decision
from sluice.worker.collective.reduce import OPS, REDUCIBLE, accumulate, divide, storage

#: no message carries a blob larger than this (collective.carry_bytes is at most this)
MAX_CARRY = 16 << 20


def carried_bytes(request: Request, limit: int) -> int:
    """The bytes of `request`'s data if it may travel with its request (an allreduce of at most `limit`
    bytes of a reducible dtype); 0 if not."""
    if request.kind != "allreduce" or request.dtype not in REDUCIBLE or data_op(request.op) not in OPS:
        return 0
    # math.prod: np.prod is 30 times slower on a model's shapes, and this runs for every request
    nbytes = sum(math.prod(shape) for shape in request.shapes) * storage(request.dtype).itemsize
    return nbytes if 0 < nbytes <= limit else 0


def check_blobs(message: Up | Down, table: Sequence[Request], where: str) -> None:
    """WireError unless each blob in `message` is the size of its entry's data, that entry may be carried
    (whatever this rank's own limit: another's may be larger), and (a Down's) is not set by the same message."""
    blobs = message.sums if isinstance(message, Up) else message.results
    if isinstance(message, Down) and blobs and {i for i, _ in blobs} & {i for i, _ in message.entries}:
        raise WireError(f"{where} carries a result for a table entry it sets")
    for index, blob in blobs:
        nbytes = carried_bytes(table[index], MAX_CARRY) if index < len(table) else 0
        if not nbytes or len(blob) != nbytes:
            raise WireError(f"{where} carries {len(blob)} bytes for table entry {index}, which takes "
                            f"{nbytes or 'none'}")


class Carrier:
    """One rank's carried data: its own and its children's by table entry; sums and results attached."""

    def __init__(self, children: Sequence[int], size: int, limit: int) -> None:
        self.children, self.size, self.limit = tuple(children), size, limit
        self._own: dict[int, np.ndarray] = {}
        self._below: dict[int, dict[int, Any]] = {child: {} for child in self.children}
        self._results: dict[int, Any] = {}  # from the parent's Downs this tick
        #: decisions this rank got with their result, since the start
        self.carried = 0

    # ------------------------------------------------------------------ inputs
    def own(self, index: int | None, request: Request, data: np.ndarray | None) -> None:
        """This rank's data for its request, which went the fast path as table entry `index` (None: it did not)."""
        if index is not None and data is not None and data.nbytes == carried_bytes(request, self.limit):
            self._own[index] = data

    def take_up(self, child: int, up: Up, epoch: int) -> None:
        """A child's Up the controller took (in join `epoch`: an earlier epoch's data is dropped)."""
        if up.epoch == epoch:
            self._below[child].update(up.sums)

    def take_down(self, down: Down, table: Sequence[Request]) -> None:
        """The parent's Down the controller took: what it decides or fails is over; its results kept."""
        for entry in bit_list(down.decided):
            self._drop(entry)
        self._drop_names({name for name, _ in down.failed}, table)
        if down.join_last >= 0:
            self._own.clear()
            for held in self._below.values():
                held.clear()
        self._results.update(down.results)

    # ------------------------------------------------------------------ outputs
    def attach(self, out: list[tuple[int, Up | Down]], decisions: list[Decision], table: Sequence[Request],
               root: bool) -> tuple[list[tuple[int, Up | Down]], list[Decision]]:
        """This tick's messages with their sums (an Up) and results (the root's Downs; others forward the
        parent's as they came), and its decisions with their results."""
        if root:
            results = self._root_results(decisions, table)
            # what the ranks that agreed sent for an op that failed must not outlive it (each child gets those Downs)
            self._drop_names({name for _, m in out if isinstance(m, Down) for name, _ in m.failed}, table)
            out = [(dest, replace(m, results=tuple((i, results[i]) for i in bit_list(m.decided) if i in results))
                    if isinstance(m, Down) else m) for dest, m in out]
        else:
            results, self._results = self._results, {}
            out = [(dest, self._with_sums(m, table) if isinstance(m, Up) else m) for dest, m in out]
        decided = []
        for decision in decisions:
            result = results.get(decision.index) if decision.error is None else None
            if result is not None:
                self.carried += 1
                decision = replace(decision, result=np.frombuffer(result, storage(decision.request.dtype)))
            decided.append(decision)
        return out, decided

    def _with_sums(self, up: Up, table: Sequence[Request]) -> Up:
        sums, budget = [], self.limit
        for index in bit_list(up.ready):
            total = self._subtree_sum(index, table[index])
            if total is not None and total.nbytes <= budget:
                sums.append((index, total))
                budget -= total.nbytes
        return replace(up, sums=tuple(sums)) if sums else up

    def _root_results(self, decisions: list[Decision], table: Sequence[Request]) -> dict[int, Any]:
        results, budget = {}, self.limit
        for decision in decisions:
            if decision.index < 0 or decision.error is not None:
                continue
            total = self._subtree_sum(decision.index, table[decision.index])
            if total is None or total.nbytes > budget:
                continue
            budget -= total.nbytes
            if data_op(decision.request.op) == "average":
                divide(total, self.size, decision.request.dtype)
            results[decision.index] = total
        return results

    def _subtree_sum(self, index: int, request: Request) -> np.ndarray | None:
        """Own data reduced with every child's (in tree order); None unless all are here. Consumes them."""
        own = self._own.pop(index, None)
        below = [held.pop(index, None) for held in self._below.values()]
        if own is None or any(blob is None for blob in below):
            return None
        total = own.copy() if below else own  # the caller's array stays as it is until the result lands in it
        op = data_op(request.op)
        for blob in below:
            accumulate(total, np.frombuffer(blob, total.dtype), request.dtype, op)
        return total

    def _drop_names(self, names: set[str], table: Sequence[Request]) -> None:
        if names:
            for entry, request in enumerate(table):
                if request.name in names:
                    self._drop(entry)

    def _drop(self, index: int) -> None:
        self._own.pop(index, None)
        for held in self._below.values():
            held.pop(index, None)
