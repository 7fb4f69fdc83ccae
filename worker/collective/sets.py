"""Process sets: a collective engine per set (its own coordinator tree, op table and sequence) over the job's links.

A set's engine is a CollectiveEngine like the job's, over the set's ranks only: its coordinator tree
is built from the members' hosts, its operations are numbered in its own sequence, its fusion and
refusals stay inside it. Its messages travel on the job's connections (every pair of workers is
connected already) as the SET_* kinds, with the set's id in meta["set"] (SetTransport); the node hands
them here and `on_message` passes each, stripped back to its COORD_*/COLL_* form, to the set's engine.
Messages for a set this rank has not registered yet (a faster member) are kept, within bounds; those
for a removed set, or an id never given, are refused.

Adding and removing a set are collectives of the whole job, as in Horovod: every worker calls them
in the same order with the same ranks. The job's engine gathers every worker's view first, so a
disagreement or a duplicate raises on every worker alike, and set ids (1, 2, ... in the order of
adding; 0 is the job) are the same everywhere.

The hierarchy's two sets (a host's workers, and one local rank's workers across hosts:
worker/hierarchy.py) are no user's: every worker knows them from the hosts alone, so they take ids of
their own range, are kept apart from the sets add() dedupes against, and their messages are kept from
the address book on, before their engines start at the first use.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sluice.errors import CollectiveError, InvalidCallError
from sluice.transport.base import Transport
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.engine import EARLY_COORDINATION, CollectiveEngine
from sluice.worker.collective.mailbox import Mailbox
from sluice.worker.collective.process_set import set_id
from sluice.worker.collective.refusal import refusing
from sluice.worker.topology import host_groups

_INNER = {Kind.SET_UP: Kind.COORD_UP, Kind.SET_DOWN: Kind.COORD_DOWN, Kind.SET_DATA: Kind.COLL_DATA,
          Kind.SET_DONE: Kind.COLL_DONE}
_OUTER = {inner: outer for outer, inner in _INNER.items()}
SET_KINDS = frozenset(_INNER)
#: sets added but not registered here yet whose messages are kept (a member may finish adding first)
EARLY_SETS = 4
#: payload kept for each such set until its engine starts (a set's first ops' early chunks)
EARLY_SET_BYTES = 64 << 20
#: the hierarchy's set ids: a host's workers LOCAL_SETS + the host's index, one local rank's CROSS_SETS + it
LOCAL_SETS, CROSS_SETS = 1 << 24, 1 << 25


class SetTransport:
    """The job's transport as a set's engine sees it: what it sends is tagged with the set's id; the
    connections exist already (the job's engine made them), so `connect` makes none."""

    def __init__(self, inner: Transport, set_id: int) -> None:
        self._inner, self._set_id = inner, set_id
        self.name: str = inner.name
        self.config: TransportConfig = inner.config
        self.tracer: Callable[[Message, float, float], None] | None = None

    def send(self, peer: str, channel: int, msg: Message) -> None:
        meta = {**(msg.meta or {}), "set": self._set_id}
        self._inner.send(peer, channel, Message(_OUTER[msg.kind], msg.sender, msg.key, msg.chunk, msg.round,
                                                msg.priority, msg.dtype, msg.shape, msg.flags, meta, msg.payload))

    def connect(self, peer: str, endpoints: Sequence[str], control: bool = False, tos: int | None = None) -> None:
        return None

    def refuse(self, peer: str, text: str) -> None:
        self._inner.refuse(peer, f"process set {self._set_id}: {text}")

    def listen(self, port: int = 0) -> list[str]:
        raise NotImplementedError("a process set listens through the job's transport")

    def replace_peer(self, peer: str, endpoints: Sequence[str], control: bool = False,
                     tos: int | None = None) -> None:
        raise NotImplementedError("a process set's peers are the job's")

    def withdraw(self, match: Callable[[str, int, Message], bool]) -> list[tuple[str, int, Message]]:
        raise NotImplementedError("a process set sends nothing it takes back")

    def alloc(self, count: int, dtype: np.dtype) -> np.ndarray:
        return self._inner.alloc(count, dtype)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        return self._inner.stats(reset)

    def set_inflight(self, nbytes: int) -> None:
        self._inner.set_inflight(nbytes)

    def close(self, flush_seconds: float = 1.0, linger_seconds: float = 2.0) -> None:
        return None

    def on_failure(self, listener: Callable[[str], None]) -> None:
        self._inner.on_failure(listener)


def _untagged(msg: Message) -> tuple[int, Message] | None:
    """The set id and the message as the set's engine expects it, or None where meta["set"] is not an id."""
    meta = msg.meta
    set_id = meta.get("set") if type(meta) is dict else None
    if type(set_id) is not int or set_id < 1:
        return None
    rest = {k: v for k, v in meta.items() if k != "set"} if meta is not None else None
    msg.kind, msg.meta = _INNER[msg.kind], rest or None
    return set_id, msg


class ProcessSets:
    """This worker's process sets: their ranks by id, and an engine for each set it belongs to."""

    def __init__(self, job: CollectiveEngine, transport: Transport, names: Sequence[str], hosts: Sequence[str],
                 make_engine: Callable[[Transport, int, list[int], list[str], list[str]], CollectiveEngine]) -> None:
        """`make_engine(transport, set id, members, peer names, hosts)` makes this worker's engine of a set of
        `members` (global ranks), with the job's settings."""
        self.job, self._transport = job, transport
        self._names, self._hosts, self._make_engine = list(names), list(hosts), make_engine
        self._lock = threading.Lock()
        self.ranks: dict[int, list[int]] = {0: list(range(job.size))}
        self._engines: dict[int, CollectiveEngine] = {}
        #: per set this worker is in (or may be about to add): its messages, to its engine once it runs
        self._boxes: dict[int, Mailbox] = {}
        self._last_id = 0
        self._calls = itertools.count()
        self._failure: str | None = None
        groups = host_groups(self._hosts, job.rank)
        #: the hierarchy's sets this worker is in (local, then cross), by id; empty where the job has none
        self._internal: dict[int, list[int]] = {} if groups is None else {
            LOCAL_SETS + groups.host: list(groups.local), CROSS_SETS + groups.local.index(job.rank): list(groups.cross)}
        for internal in self._internal:
            self._boxes[internal] = Mailbox(EARLY_COORDINATION, self._transport.refuse, EARLY_SET_BYTES)
        self._internal_lock = threading.Lock()

    # ------------------------------------------------------------------ callers (collectives of the job)
    def add(self, ranks: Sequence[int]) -> int | None:
        """Register a set of `ranks` on every worker (every worker calls this alike); its id, or None where a
        set of these ranks exists already. InvalidCallError for ranks outside the job, on every worker."""
        call = f"process_set.add.{next(self._calls)}"
        with refusing(call, lambda: self.job):
            members = sorted(ranks)
            if not members or len(set(members)) != len(members) or not all(
                    type(r) is int and 0 <= r < self.job.size for r in members):
                raise InvalidCallError(f"a process set needs distinct ranks of this job (0..{self.job.size - 1}), "
                                       f"got {list(ranks)}")
        views = self._gather(call, np.isin(np.arange(self.job.size), members))
        if not (views == views[0]).all():
            seen = "; ".join(f"rank {r}: {np.flatnonzero(v).tolist()}" for r, v in enumerate(views))
            raise CollectiveError(f"add_process_set: the workers disagree on the ranks: {seen}")
        with self._lock:
            if members in self.ranks.values():
                return None
            self._last_id += 1
            set_id = self._last_id
            self.ranks[set_id] = members
            if self.job.rank in members:
                self._boxes.setdefault(set_id, Mailbox(EARLY_COORDINATION, self._transport.refuse, EARLY_SET_BYTES))
            else:
                self._boxes.pop(set_id, None)
        if self.job.rank in members:
            self._start(set_id, members)
        return set_id

    def remove(self, set_id: int) -> bool:
        """Unregister set `set_id` on every worker (every worker calls this alike): True where it existed.
        Its engine closes; what its members still send is refused."""
        call = f"process_set.remove.{next(self._calls)}"
        views = self._gather(call, np.array([set_id], np.int64))
        if not (views == set_id).all():
            raise CollectiveError(f"remove_process_set: the workers disagree on the set: "
                                  f"{'; '.join(f'rank {r}: {int(v[0])}' for r, v in enumerate(views))}")
        with self._lock:
            if set_id == 0 or self.ranks.pop(set_id, None) is None:
                return False
            engine = self._engines.pop(set_id, None)
            self._boxes.pop(set_id, None)
        if engine is not None:
            engine.close()
        return True

    def engine(self, set_id: int | None, what: str) -> CollectiveEngine:
        """The engine of set `set_id` (0: the job's); CollectiveError (Horovod's HorovodInternalError) where the
        set does not exist or this worker is not in it."""
        if set_id == 0:
            return self.job
        with self._lock:
            ranks = self.ranks.get(set_id) if set_id is not None else None
            engine = self._engines.get(set_id) if set_id is not None else None
        if ranks is None:
            raise CollectiveError(f"{what}: Process set provided does not exist, or has not been registered.")
        if engine is None:
            raise CollectiveError(f"{what}: Rank {self.job.rank} is not a member of the provided process set "
                                  f"(ranks {ranks}).")
        return engine

    def ranks_of(self, process_set: Any) -> list[int] | None:
        """The global ranks of a collective's `process_set=` (None: every worker), or None for a set not registered."""
        registered = set_id(process_set)
        with self._lock:
            return self.ranks.get(registered) if registered is not None else None

    def member_engine(self, process_set: Any) -> CollectiveEngine | None:
        """The engine of `process_set`, or None where this worker is not in the set (Horovod then leaves its
        gradients out); CollectiveError for a set not registered."""
        ranks = self.ranks_of(process_set)
        if ranks is not None and self.job.rank not in ranks:
            return None
        return self.engine(set_id(process_set), "collective")

    def hierarchy(self) -> tuple[CollectiveEngine, CollectiveEngine] | None:
        """This worker's engines of its host's workers and of its local rank's workers on every host (started at
        the first call), or None where the job has no hierarchy (worker/topology.py `host_groups`)."""
        if not self._internal:
            return None
        with self._internal_lock:
            for internal, members in self._internal.items():
                with self._lock:
                    started = internal in self._engines
                if not started:
                    self._start(internal, members)
            with self._lock:
                local, cross = (self._engines[internal] for internal in self._internal)
        return local, cross

    # ------------------------------------------------------------------ the node's handler
    def on_message(self, peer: str, msg: Message) -> None:
        """A SET_* message (I/O thread): to its set's engine, kept for a set about to be added, else refused."""
        found = _untagged(msg)
        if found is None:
            self._transport.refuse(peer, f"dropped {msg.kind.name} from {peer!r:.60}: meta has no process set id")
            return
        set_id, inner = found
        with self._lock:
            box = self._boxes.get(set_id)
            if box is None and self._last_id < set_id <= self._last_id + EARLY_SETS:
                box = self._boxes[set_id] = Mailbox(EARLY_COORDINATION, self._transport.refuse, EARLY_SET_BYTES)
        if box is not None:
            box.deliver(peer, inner)  # to the set's engine, or kept until it starts (in order)
        else:
            self._transport.refuse(peer, f"dropped {inner.kind.name} of process set {set_id} from {peer!r:.60}: "
                                         "no such set here (removed, never added, or this worker is not in it)")

    def worker_left(self, rank: int, who: str, error: str = "") -> None:
        with self._lock:
            engines = [({**self.ranks, **self._internal}[i], e) for i, e in self._engines.items()]
        for ranks, engine in engines:
            if rank in ranks:
                engine.worker_left(ranks.index(rank), who, error)

    def fail(self, error: str) -> None:
        with self._lock:
            self._failure = error
            engines = list(self._engines.values())
        for engine in engines:
            engine.fail(error)

    def close(self) -> None:
        with self._lock:
            engines, self._engines, self._boxes = list(self._engines.values()), {}, {}
        for engine in engines:
            engine.close()

    # ------------------------------------------------------------------ internals
    def _gather(self, call: str, row: np.ndarray) -> np.ndarray:
        """Every worker's `row` (one per rank) through the job's engine."""
        flat = np.ascontiguousarray(row.astype(np.int64)).reshape(1, -1)
        rows = self.job.allgather(call, flat, "int64").result()
        return np.asarray(rows).reshape(self.job.size, -1)

    def _start(self, set_id: int, members: list[int]) -> None:
        """This worker's engine for the set: made, connected to the other members (their hellos), its early
        messages replayed."""
        engine = self._make_engine(SetTransport(self._transport, set_id), set_id, members,
                                   [self._names[r] for r in members], [self._hosts[r] for r in members])
        with self._lock:
            self._engines[set_id] = engine
            box = self._boxes[set_id]
            failure = self._failure
        box.attach(engine.on_message)  # what came early first, then each message as it comes
        if failure is not None:
            engine.fail(failure)
        engine.connect([[] for _ in members])


def set_engine_factory(transport: Transport, settings: CollectiveConfig, chunk_bytes: int, timeout: float,
                       channel_for: Callable[[int], int], rank: int
                       ) -> Callable[[Transport, int, list[int], list[str], list[str]], CollectiveEngine]:
    """What ProcessSets calls to make the engine of worker `rank` in a set: the job engine's settings; its
    errors name the set."""
    def make(set_transport: Transport, set_id: int, members: list[int], names: list[str],
             hosts: list[str]) -> CollectiveEngine:
        return CollectiveEngine(set_transport, members.index(rank), names, hosts, settings, chunk_bytes, timeout,
                                channel_for, members=members, label=f" in process set {set_id} (ranks {members})",
                                set_id=set_id)
    return make
