"""The coordinator tree's messages (worker/collective/negotiation.py): their wire encoding, and their checks.

Both directions are one `Message` each: header fields carry the counters, meta (omitted when empty)
plain msgpack values, and a uint8 payload the bit-vector, so the steady-state message is a header of
about 25 bytes plus ceil(table / 8) bytes.

    COORD_UP    round = seq (1, 2, ...; 0 = hello), key = join epoch, payload = newly ready bits from
                byte `chunk` on (the zero bytes below it are not sent)
                meta  n: [[name, kind, dtype, shapes, op, root, priority, rep], ...]  new ops complete below
                      w: true (every rank below has joined)     j: [rank, ...] ranks that joined below
                      st: [name, ...] stalled here               e: error text
                      x: [[name, text], ...] ops complete below whose ranks disagree (a mismatch)
                      c: [query, [[name, kind, dtype, shapes, op, root, bitmap], ...], [other name, ...],
                          more, [silent child, ...]]           a stall census answer
    COORD_DOWN  round = ack (the last seq taken from this child; 0 = none), payload = decided bits
                from byte `chunk` on
                meta  t: [[index, name, kind, dtype, shapes, op, root, priority], ...]  table entries set
                      j: [rank, ...] newly joined   jl: last rank to join (the join is decided)
                      q: [query, [name, ...]] stall census   e: error text
                      f: [[name, text], ...] ops decided as failed (their ranks disagree): each rank's fails
    hello       either kind, meta {hello: true} and nothing else: sent once by the side that dialled

Either direction may carry small operations' data (worker/collective/carry.py): meta `v: [[index, nbytes],
...]`, and the payload is the bit-vector followed by those blobs in order (an Up's subtree sums of entries
it marks ready, a Down's results of entries it decides).

Bits are little-endian: bit i of the vector is bit i % 8 of byte i // 8. `decode_up` and `decode_down`
check the format; `check_up` and `check_down` whether the content fits the receiver's state (sequence,
join epoch, table, subtree). All raise WireError only. `pack_decisions` splits the root's decisions into
messages whose headers stay under META_BUDGET of descriptions.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.transport.wire import MAX_DIMS, Kind, Message, WireError, brief
from sluice.worker.collective.negotiation_request import MAX_NAME, MAX_TENSORS, Request, problem

MAX_RANKS = 1 << 20
MAX_TEXT = 8192
#: no table is longer (a Controller's capacity is at most this): bit-vectors are at most MAX_TABLE / 8 bytes
MAX_TABLE = 1 << 20
#: bytes of op descriptions put in one message; a header stays well under DATA_HEADER_BYTES (64 KiB)
META_BUDGET = 24 << 10
#: no message carries more data blobs than this (one per table entry it marks)
MAX_BLOBS = 4096

#: (table index, data) pairs: outgoing, arrays (any buffer); received, bytes of their own
Blobs = tuple[tuple[int, Any], ...]


@dataclass(frozen=True)
class Answer:
    """A subtree's answer to a stall census: who below submitted the queried ops, and what else waits."""

    query: int
    #: (request as submitted, bitmap of the ranks that submitted it) per queried name and description
    found: tuple[tuple[Request, int], ...] = ()
    others: tuple[str, ...] = ()  # other ops pending below (at most MAX_OTHERS)
    more: int = 0  # how many more
    silent: tuple[int, ...] = ()  # children that did not answer in time (their subtrees unknown)


@dataclass(frozen=True)
class Up:
    """Child to parent: what became true of the child's whole subtree since its last message."""

    seq: int
    epoch: int = 0
    ready: int = 0
    new: tuple[tuple[Request, int], ...] = ()  # (request, lowest rank that submitted it) complete below
    wild: bool = False
    joined: tuple[int, ...] = ()
    stalled: tuple[str, ...] = ()
    answer: Answer | None = None
    error: str | None = None
    #: (name, what disagrees) of ops every rank below has submitted, in descriptions that disagree
    conflicts: tuple[tuple[str, str], ...] = ()
    #: (index, the subtree's sum) of entries in `ready` whose data travels with the request (carry.py)
    sums: Blobs = field(default=(), compare=False)


@dataclass(frozen=True)
class Down:
    """Parent to child: table entries, decisions, joins, a census query or the job's error."""

    ack: int = 0
    entries: tuple[tuple[int, Request], ...] = ()
    decided: int = 0
    joined: tuple[int, ...] = ()
    join_last: int = -1
    query: tuple[int, tuple[str, ...]] | None = None
    error: str | None = None
    #: (name, why) of ops decided as failed: every rank's submission of each ends with the error; the job goes on
    failed: tuple[tuple[str, str], ...] = ()
    #: (index, the op's result) of entries in `decided` whose data came up with the requests (carry.py)
    results: Blobs = field(default=(), compare=False)


MAX_OTHERS = 16
#: the longest mismatch text a message carries (two descriptions and two ranks fit easily)
MAX_CONFLICT_TEXT = 2048


def _req(r: Request) -> list[Any]:
    return [r.name, r.kind, r.dtype, [list(s) for s in r.shapes], r.op, r.root]


def _bits(value: int) -> bytes | None:
    return value.to_bytes((value.bit_length() + 7) // 8, "little") if value else None


def _message(kind: Kind, sender: int, round_: int, key: int, meta: dict[str, Any], bits: int,
             blobs: Blobs = ()) -> Message:
    if not bits:
        return Message(kind, sender=sender, key=key, round=round_, meta=meta or None)
    skip = ((bits & -bits).bit_length() - 1) // 8  # leading zero bytes are not sent: ops become ready in order
    payload = (bits >> 8 * skip).to_bytes(((bits >> 8 * skip).bit_length() + 7) // 8, "little")
    if blobs:  # one buffer: the bit-vector, then the data (a copy, made as the message is composed)
        views = [memoryview(blob).cast("B") for _, blob in blobs]
        meta["v"] = [[index, view.nbytes] for (index, _), view in zip(blobs, views, strict=True)]
        payload = b"".join([payload, *views])
    return Message(kind, sender=sender, key=key, chunk=skip, round=round_, meta=meta or None, dtype="uint8",
                   shape=(len(payload),), payload=payload)


def encode_up(up: Up, sender: int = -1) -> Message:
    meta: dict[str, Any] = {}
    if up.new:
        meta["n"] = [[*_req(r), r.priority, rep] for r, rep in up.new]
    if up.wild:
        meta["w"] = True
    if up.joined:
        meta["j"] = list(up.joined)
    if up.stalled:
        meta["st"] = list(up.stalled)
    if up.answer is not None:
        a = up.answer
        found = [[*_req(r), _bits(bitmap) or b""] for r, bitmap in a.found]
        meta["c"] = [a.query, found, list(a.others), a.more, list(a.silent)]
    if up.error is not None:
        meta["e"] = up.error
    if up.conflicts:
        meta["x"] = [list(pair) for pair in up.conflicts]
    return _message(Kind.COORD_UP, sender, up.seq, up.epoch, meta, up.ready, up.sums)


def encode_down(down: Down, sender: int = -1) -> Message:
    meta: dict[str, Any] = {}
    if down.entries:
        meta["t"] = [[index, *_req(r), r.priority] for index, r in down.entries]
    if down.joined:
        meta["j"] = list(down.joined)
    if down.join_last >= 0:
        meta["jl"] = down.join_last
    if down.query is not None:
        meta["q"] = [down.query[0], list(down.query[1])]
    if down.error is not None:
        meta["e"] = down.error
    if down.failed:
        meta["f"] = [list(pair) for pair in down.failed]
    return _message(Kind.COORD_DOWN, sender, down.ack, 0, meta, down.decided, down.results)


def hello(kind: Kind, sender: int = -1) -> Message:
    """The first message on a connection, from the side that dialled: the other side learns its route."""
    return Message(kind, sender=sender, meta={"hello": True})


def is_hello(msg: Message) -> bool:
    return msg.meta is not None and msg.meta.get("hello") is True and len(msg.meta) == 1


# ---------------------------------------------------------------------------- decoding
def _list(value: Any, what: str, limit: int) -> list[Any]:
    if type(value) is not list or len(value) > limit:
        raise WireError(f"{what} must be a list of at most {limit} items, got {brief(value)}")
    return value


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value < high:
        raise WireError(f"{what} must be an int in [{low}, {high}), got {brief(value)}")
    return value


def _text(value: Any, what: str, limit: int) -> str:
    if type(value) is not str or not 0 < len(value) <= limit:
        raise WireError(f"{what} must be a string of 1 to {limit} characters, got {brief(value)}")
    return value


def _request(fields: list[Any], priority: Any = 0) -> Request:
    name, kind, dtype, shapes, op, root = fields
    shapes = _list(shapes, "shapes", MAX_TENSORS)
    request = Request(_text(name, "a name", MAX_NAME), kind if type(kind) is str else "", dtype,
                      tuple(tuple(_list(s, "a shape", MAX_DIMS)) for s in shapes), op, root, priority)
    found = problem(request, MAX_RANKS)
    if found:
        raise WireError(f"collective {name!r:.60}: {found}")
    return request


def _row(value: Any, length: int, what: str) -> list[Any]:
    row = _list(value, what, length)
    if len(row) != length:
        raise WireError(f"{what} must have {length} fields, got {len(row)}")
    return row


def _ranks(value: Any, what: str) -> tuple[int, ...]:
    return tuple(_int(r, what, 0, MAX_RANKS) for r in _list(value, what, MAX_RANKS))


def _names(value: Any, what: str, limit: int) -> tuple[str, ...]:
    return tuple(_text(n, what, MAX_NAME) for n in _list(value, what, limit))


def _conflicts(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    pairs = tuple((_text(row[0], "a name", MAX_NAME), _text(row[1], "a mismatch", MAX_CONFLICT_TEXT))
                  for row in (_row(r, 2, what) for r in _list(value, what + "s", MAX_TENSORS)))
    if len({name for name, _ in pairs}) != len(pairs):
        raise WireError(f"{what}s name an op twice")
    return pairs


def _payload(msg: Message, meta: dict[str, Any]) -> tuple[int, Blobs]:
    """The bit-vector and the data blobs (each bytes of its own, for a bit it sets) in a payload."""
    if msg.payload is None:
        if "v" in meta:
            raise WireError("data blobs without a payload")
        return 0, ()
    if msg.dtype != "uint8" or len(msg.shape) != 1:
        raise WireError(f"a bit-vector is a 1-D uint8 payload, got {msg.dtype} {list(msg.shape)}")
    rows = [_row(r, 2, "a data blob") for r in _list(meta.get("v", []), "data blobs", MAX_BLOBS)]
    sizes = [(_int(index, "a table index", 0, MAX_TABLE), _int(nbytes, "a blob's size", 0, 1 << 31))
             for index, nbytes in rows]
    if len({index for index, _ in sizes}) != len(sizes):
        raise WireError("data blobs name a table entry twice")
    length = msg.shape[0] - sum(nbytes for _, nbytes in sizes)
    if length <= 0:
        raise WireError(f"data blobs of {msg.shape[0] - length} bytes leave no bit-vector in {msg.shape[0]}")
    if msg.chunk + length > MAX_TABLE // 8:  # before building an int of that many bytes
        raise WireError(f"a bit-vector reaches byte {msg.chunk + length}, beyond {MAX_TABLE // 8}")
    view = memoryview(msg.payload).cast("B")
    bits = int.from_bytes(view[:length], "little") << 8 * msg.chunk
    blobs, at = [], length
    for index, nbytes in sizes:
        if not bits >> index & 1:
            raise WireError(f"data for table entry {index}, which the message does not mark")
        blobs.append((index, bytes(view[at:at + nbytes])))  # its own: a received payload may be reused
        at += nbytes
    return bits, tuple(blobs)


def _answer(value: Any) -> Answer:
    query, found, others, more, silent = _row(value, 5, "a census answer")
    rows = [_row(f, 7, "a census entry") for f in _list(found, "census entries", MAX_OTHERS)]
    for row in rows:
        if type(row[6]) is not bytes or len(row[6]) > MAX_RANKS // 8:
            raise WireError(f"a census bitmap must be bytes, got {brief(row[6])}")
    return Answer(_int(query, "a census query", 1, 1 << 62),
                  tuple((_request(row[:6]), int.from_bytes(row[6], "little")) for row in rows),
                  _names(others, "a waiting op", MAX_OTHERS), _int(more, "a count", 0, 1 << 31),
                  _ranks(silent, "a silent child"))


def decode_up(msg: Message) -> Up:
    """The Up in a COORD_UP message (not a hello); WireError if it does not follow the format."""
    meta = msg.meta or {}
    unknown = set(meta) - {"n", "w", "j", "st", "c", "e", "x", "v"}
    if unknown:
        raise WireError(f"COORD_UP meta has unknown fields {sorted(unknown)[:4]}")
    new = tuple((_request(row[:6], _int(row[6], "a priority", 0, 1 << 31)), _int(row[7], "a rank", 0, MAX_RANKS))
                for row in (_row(r, 8, "a new op") for r in _list(meta.get("n", []), "new ops", MAX_TENSORS)))
    if meta.get("w", False) is not True and "w" in meta:
        raise WireError(f"COORD_UP field 'w' must be true, got {brief(meta['w'])}")
    ready, sums = _payload(msg, meta)
    return Up(
        seq=_int(msg.round, "a sequence number", 1, 1 << 62), epoch=msg.key, ready=ready, sums=sums, new=new,
        wild="w" in meta, joined=_ranks(meta.get("j", []), "a joined rank"),
        stalled=_names(meta.get("st", []), "a stalled op", MAX_TENSORS),
        answer=_answer(meta["c"]) if "c" in meta else None,
        error=_text(meta["e"], "an error", MAX_TEXT) if "e" in meta else None,
        conflicts=_conflicts(meta.get("x", []), "a conflict"),
    )


def decode_down(msg: Message) -> Down:
    """The Down in a COORD_DOWN message (not a hello); WireError if it does not follow the format."""
    meta = msg.meta or {}
    unknown = set(meta) - {"t", "j", "jl", "q", "e", "f", "v"}
    if unknown:
        raise WireError(f"COORD_DOWN meta has unknown fields {sorted(unknown)[:4]}")
    entries = tuple((_int(row[0], "a table index", 0, MAX_TABLE), _request(row[1:7], _int(row[7], "a priority", 0,
                                                                                          1 << 31)))
                    for row in (_row(r, 8, "a table entry") for r in _list(meta.get("t", []), "entries", 1 << 20)))
    query = None
    if "q" in meta:
        qid, names = _row(meta["q"], 2, "a census query")
        query = (_int(qid, "a census query", 1, 1 << 62), _names(names, "a queried op", MAX_OTHERS))
    decided, results = _payload(msg, meta)
    return Down(
        ack=msg.round, entries=entries, decided=decided, results=results,
        joined=_ranks(meta.get("j", []), "a joined rank"),
        join_last=_int(meta["jl"], "the last rank to join", 0, MAX_RANKS) if "jl" in meta else -1, query=query,
        error=_text(meta["e"], "an error", MAX_TEXT) if "e" in meta else None,
        failed=_conflicts(meta.get("f", []), "a failed op"),
    )


def up_size(new: tuple[Request, int] | Request) -> int:
    """About how many header bytes an op's description takes (to keep messages under META_BUDGET)."""
    r = new[0] if isinstance(new, tuple) else new
    return 32 + len(r.name.encode()) + sum(4 + 5 * len(s) for s in r.shapes)


def pack_decisions(items: list[tuple[int, Request | None]], joined: tuple[int, ...]) -> list[Down]:
    """The root's Downs for decisions in order: (table index, the entry's request if it is new or changed).
    One Down unless new entries' descriptions would crowd a header; `joined` goes in the first."""
    sizes = [0 if request is None else up_size(request) for _, request in items]
    downs, start = [], 0
    while start < len(items):
        budget, end = META_BUDGET - sizes[start], start + 1
        while end < len(items) and budget >= sizes[end]:
            budget -= sizes[end]
            end += 1
        chunk = items[start:end]
        downs.append(Down(entries=tuple((i, r) for i, r in chunk if r is not None),
                          decided=sum(1 << i for i, _ in chunk), joined=joined if start == 0 else ()))
        start = end
    return downs


# ---------------------------------------------------------------------------- fit to the receiver's state
def check_up(up: Up, where: str, last: int, epoch: int, table: int, below: frozenset[int],
             joined: Collection[int], reported: Collection[str]) -> None:
    """An Up fits a parent that took message `last` from this child, is in join `epoch`, has `table`
    entries, and knows `joined` ranks of its subtree joined; `below`: the child's subtree, `reported`:
    the names it has reported (new or conflicted) that no decision has consumed yet."""
    if up.seq != last + 1:
        raise WireError(f"{where} follows {last}")
    if up.epoch > epoch:
        raise WireError(f"{where} is from join epoch {up.epoch}, ahead of {epoch}")
    if up.epoch == epoch:
        if up.ready.bit_length() > table:
            raise WireError(f"{where} marks entry {up.ready.bit_length() - 1} of a table of {table}")
        if any(rep not in below for _, rep in up.new) or any(r not in below for r in up.joined):
            raise WireError(f"{where} names a rank outside its subtree")
        if any(r in joined for r in up.joined) or len(set(up.joined)) != len(up.joined):
            raise WireError(f"{where} reports a rank joined twice")
        if up.wild and not below <= {*joined, *up.joined}:
            raise WireError(f"{where} says its subtree joined, but not all of it has")
        names = [r.name for r, _ in up.new] + [name for name, _ in up.conflicts]
        if len(set(names)) != len(names) or any(name in reported for name in names):
            raise WireError(f"{where} reports an op it has reported already")
    if up.answer is not None:
        mask = sum(1 << r for r in below)
        if any(bits & ~mask for _, bits in up.answer.found) or any(r not in below for r in up.answer.silent):
            raise WireError(f"{where} answers the census for ranks outside its subtree")


def check_down(down: Down, where: str, sent: int, table: Sequence[Request], index: Mapping[str, int],
               capacity: int, size: int, joined: Collection[int], pending: Collection[str] | None) -> None:
    """A Down fits a child that sent `sent` messages up, holds `table` (`index`: name -> entry) of at
    most `capacity` entries, in a job of `size` ranks of which it knows `joined` joined, and has its own
    requests `pending` (None: it has joined, so an op may fail that it never submitted)."""
    if down.ack > sent:
        raise WireError(f"{where} acknowledges message {down.ack}, but {sent} were sent")
    length, names = len(table), dict(index)
    for at, request in down.entries:
        if at == length:
            length += 1
        elif at > length or table[at].name != request.name:
            raise WireError(f"{where} sets table entry {at} of {length} to {request.name!r:.60}")
        if names.setdefault(request.name, at) != at:
            raise WireError(f"{where} gives {request.name!r:.60} a second index")
    if length > capacity or down.decided.bit_length() > length:
        raise WireError(f"{where} decides entries beyond the table ({length})")
    if any(r >= size or r in joined for r in down.joined) or len(set(down.joined)) != len(down.joined):
        raise WireError(f"{where} reports a joined rank that is unknown or joined already")
    if down.join_last >= size:
        raise WireError(f"{where} names rank {down.join_last} as the last to join")
    if down.failed:  # every rank that has not joined submitted an op before it can fail
        decided = {name for name, at in names.items() if down.decided >> at & 1}
        if any(name in decided or (pending is not None and name not in pending) for name, _ in down.failed):
            raise WireError(f"{where} fails an op this rank has not submitted, or decides it too")
