"""What machine 0 keeps for the launchers of a job run one per machine: their ranks and the job's starts (pure).

torchrun's c10d rendezvous numbers the machines of a job itself, so the usual `srun torchrun --nnodes 4
--rdzv-backend c10d --rdzv-endpoint HEAD:29400 ...` gives no machine a rank, and its --max-restarts starts every
machine's workers again when one fails. Here machine 0 (the machine with the rendezvous address, which runs the
scheduler) answers the other launchers (launch/machine_zero.py) from a JobBook:
- `rank` (--nnodes N): ranks 1..N-1 in the order machines ask, one per launcher (a random token, so a request sent
  again gets the same rank) for the whole job; one machine too many is refused, saying so;
- `join` (--nnodes MIN:MAX, torchrun's elastic range): each start is a round that machines join, machine 0 first;
  it closes when MAX have joined, or LAST_CALL seconds after the MIN-th did (torchrun's last_call_timeout), and
  its machines are ranked in the order they joined, the job's size being theirs. A machine that comes while a
  start runs, with room left, begins the next start (every machine's processes start again, as torchrun's agents
  restart for a waiting node: not counted as a failure); one that stops asking before its round closes is dropped;
- `start` and `failed`: the job's current start, which machine 0 has started (`ready`: the others start theirs
  after it, so no worker meets the last start's scheduler), and whether the job is `over` (a start failed with no
  restart left). A launcher whose processes failed reports its start and what failed (`cause`: its machine and the
  process it blames); the first report of the current start begins the next one (counted in `failures`,
  torchrun's restart count) and its cause is every answer's `failure` until a start begins for another reason, so
  every machine can say which machine's process ended or restarted the job; later reports change nothing.
Every request names the asker's --nnodes, --nproc-per-node and --max-restarts, which must be machine 0's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from sluice.transport.request_server import json_within

PROTOCOL = 3
MAX_REQUEST_BYTES = 1024
MAX_REPLY_BYTES = 1024
OPS = ("rank", "join", "start", "failed")
#: a machine in a round still open that has not asked for this long is taken for gone (it asks every 0.2 s)
STALE_S = 10.0
#: a failure's cause, as a launcher words it: printable ASCII (JSON keeps it at one byte a character) this long at most
MAX_CAUSE = 240
_FIELDS = {"v", "op", "token", "host", "min_nodes", "max_nodes", "nproc", "restarts", "start", "cause"}
_ANSWER_FIELDS = {"v", "rank", "nnodes", "error", "start", "failures", "ready", "over", "failure"}


@dataclass(frozen=True)
class Ask:
    op: str  # rank | join | start | failed
    token: str  # random, per launcher
    host: str  # the asking machine's name, for machine 0's log and its errors
    min_nodes: int
    max_nodes: int
    nproc: int
    restarts: int
    start: int = 0  # failed: the start whose processes failed
    cause: str = ""  # failed: which machine's process failed and how (cause_text)


@dataclass(frozen=True)
class Answer:
    rank: int | None  # the asker's rank (rank; join: once its round closed), else None
    nnodes: int  # the machines of the current start (0 while its round is open)
    error: str  # why machine 0 refuses ("" when it does not)
    start: int  # the job's current start
    failures: int  # the starts that failed so far (torchrun's restart count)
    ready: int  # the latest start machine 0 has started
    over: bool  # a start failed with no restart left: every machine ends
    failure: str = ""  # the cause of the failure that began the current start, or ended the job ("" none)


def new_ask(op: str, nodes: tuple[int, int], nproc: int, restarts: int, token: str = "", start: int = 0) -> Ask:
    return Ask(op, token or os.urandom(16).hex(), os.uname().nodename[:253] or "?", nodes[0], nodes[1], nproc,
               restarts, start)


def cause_text(text: str) -> str:
    """`text` as a failure's cause on the wire: printable ASCII (others as '?'), at most MAX_CAUSE characters."""
    plain = "".join(c if c.isascii() and c.isprintable() else "?" for c in " ".join(text.split()))
    return plain if len(plain) <= MAX_CAUSE else plain[:MAX_CAUSE - 3] + "..."


def _cause(raw: dict[str, object], key: str) -> str:
    value = raw[key]
    if type(value) is not str or len(value) > MAX_CAUSE or not (value.isascii() and value.isprintable()):
        raise ValueError(f"{key} must be printable ASCII of at most {MAX_CAUSE} characters")
    return value


def _json_object(data: bytes, limit: int, fields: set[str]) -> dict[str, object]:
    raw = json_within(data, limit, "")
    if type(raw) is not dict or set(raw) != fields or raw["v"] != PROTOCOL:
        raise ValueError(f"not a machine-0 message of protocol {PROTOCOL} ({', '.join(sorted(fields))})")
    return raw


def _count(raw: dict[str, object], key: str, low: int, high: int) -> int:
    value = raw[key]
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{key} must be an integer from {low} to {high}")
    return value


def encode_ask(ask: Ask) -> bytes:
    return json.dumps({"v": PROTOCOL, **asdict(ask)}).encode()


def parse_ask(data: bytes) -> Ask:
    """A launcher's request, or ValueError saying what is wrong with it."""
    raw = _json_object(data, MAX_REQUEST_BYTES, _FIELDS)
    op, token, host = raw["op"], raw["token"], raw["host"]
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}")
    if type(token) is not str or not 16 <= len(token) <= 64 or not all(c in "0123456789abcdef" for c in token):
        raise ValueError("a token must be 16 to 64 hex digits")
    if type(host) is not str or not 0 < len(host) <= 253 or not host.isprintable():
        raise ValueError("a host name must be 1 to 253 printable characters")
    low = _count(raw, "min_nodes", 1, 65536)
    return Ask(str(op), token, host, low, _count(raw, "max_nodes", max(low, 2), 65536), _count(raw, "nproc", 1, 4096),
               _count(raw, "restarts", 0, 10**6), _count(raw, "start", 0, 10**6), _cause(raw, "cause"))


def encode_answer(answer: Answer) -> bytes:
    body = asdict(answer)
    body["error"] = answer.error[:MAX_REPLY_BYTES // 2]
    return json.dumps({"v": PROTOCOL, **body}).encode()


def parse_answer(data: bytes) -> Answer:
    """Machine 0's answer, or ValueError."""
    raw = _json_object(data, MAX_REPLY_BYTES, _ANSWER_FIELDS)
    error, over = raw["error"], raw["over"]
    if type(error) is not str or type(over) is not bool:
        raise ValueError("an answer's error is a string and over a boolean")
    rank = None if raw["rank"] is None else _count(raw, "rank", 1, 65535)
    return Answer(rank, _count(raw, "nnodes", 0, 65536), error, _count(raw, "start", 0, 10**6),
                  _count(raw, "failures", 0, 10**6), _count(raw, "ready", 0, 10**6), over, _cause(raw, "failure"))


def nodes_text(nodes: tuple[int, int]) -> str:
    """--nnodes as given: N, or MIN:MAX."""
    return str(nodes[0]) if nodes[0] == nodes[1] else f"{nodes[0]}:{nodes[1]}"


class JobBook:
    """Machine 0's ranks handed out and the job's starts (not thread-safe: the service holds a lock). `last_call_s`:
    how long a round of an elastic range stays open after its MIN-th machine joined; `stale_s`: how long a machine in
    an open round may go without asking."""

    def __init__(self, nodes: tuple[int, int], nproc: int, restarts: int, last_call_s: float = 30.0,
                 stale_s: float = STALE_S) -> None:
        self.nodes, self.nproc, self.restarts, self.last_call_s, self.stale_s = nodes, nproc, restarts, last_call_s, \
            stale_s
        self.given: dict[str, tuple[int, str]] = {}  # token -> (rank, host): --nnodes N's, or the current round's
        self.start = self.ready = self.failures = 0
        self.over = False
        #: the cause of the failure that began the current start or ended the job; "" when none did
        self.failure = ""
        #: an elastic range's round: closed (its machines settled), when it closes at the latest, who asked when
        self.closed = nodes[0] == nodes[1]
        self.deadline: float | None = None
        self.heard: dict[str, float] = {}
        #: machines that came while a start ran, in order: the next round's first
        self.waiting: dict[str, str] = {}

    @property
    def nnodes(self) -> int:
        """The machines of the current start, machine 0 with them (0 while its round is open)."""
        if self.nodes[0] == self.nodes[1]:
            return self.nodes[0]
        return 1 + len(self.given) if self.closed else 0

    def answer(self, ask: Ask, now: float) -> Answer:
        """What machine 0 says to `ask` at time `now`, after taking it in."""
        self.tick(now)
        error, rank = self._mismatch(ask), None
        if not error and ask.op == "rank":
            rank, error = self._rank(ask)
        elif not error and ask.op == "join":
            rank, error = self._join(ask, now)
        elif not error and ask.op == "failed":
            self.failed(ask.start, now, ask.cause)
        return Answer(rank, self.nnodes, error, self.start, self.failures, self.ready, self.over, self.failure)

    def tick(self, now: float) -> None:
        """An elastic round drops machines that stopped asking, and closes at MAX, or at its last call after MIN."""
        if self.closed:
            return
        for token in [t for t in (*self.given, *self.waiting) if now - self.heard.get(t, now) > self.stale_s]:
            self.given.pop(token, None)
            self.waiting.pop(token, None)
            self.heard.pop(token, None)
        joined = 1 + len(self.given)
        if joined < self.nodes[0]:
            self.deadline = None
        elif self.deadline is None:
            self.deadline = now + self.last_call_s
        if joined >= self.nodes[1] or (self.deadline is not None and now >= self.deadline):
            self.closed = True  # ranked in the order they joined, machine 0 first
            self.given = {token: (rank, host) for rank, (token, (_, host)) in enumerate(self.given.items(), 1)}

    def failed(self, start: int, now: float, cause: str = "") -> None:
        """A machine's processes of `start` failed (`cause`: which, and how): the next start begins, or with no restart
        left the job is over."""
        if start == self.start and not self.over:
            self.failure = cause_text(cause)
            if self.failures < self.restarts:
                self.failures += 1
                self._next(now)
            else:
                self.over = True

    def _next(self, now: float) -> None:
        self.start += 1
        if self.nodes[0] == self.nodes[1]:
            return  # --nnodes N: the same machines, with the same ranks
        self.given, self.closed, self.deadline = {}, False, None
        for token, host in list(self.waiting.items())[:self.nodes[1] - 1]:
            self.given[token] = (0, host)  # ranked when the round closes
            del self.waiting[token]
        self.tick(now)

    def _mismatch(self, ask: Ask) -> str:
        ours = (self.nodes, self.nproc, self.restarts)
        theirs = ((ask.min_nodes, ask.max_nodes), ask.nproc, ask.restarts)
        if ours == theirs:
            return ""
        return (f"machine 0 runs --nnodes {nodes_text(ours[0])} --nproc-per-node {ours[1]} --max-restarts {ours[2]}, "
                f"and {ask.host} was started with --nnodes {nodes_text(theirs[0])} --nproc-per-node {theirs[1]} "
                f"--max-restarts {theirs[2]}: start every machine with the same")

    def _all_here(self, ask: Ask) -> str:
        hosts = ", ".join(f"{rank} {host}" for rank, host in sorted(self.given.values()))
        return (f"the job's {self.nodes[1]} machines are all here (machine 0 and {hosts}), and {ask.host} asked to "
                "join too: is --nnodes right, or does a machine run `sluice launch` twice?")

    def _rank(self, ask: Ask) -> tuple[int | None, str]:
        if self.nodes[0] != self.nodes[1]:
            return None, f"{ask.host} asked for a fixed rank, but the job's --nnodes is a range: start it the same way"
        if ask.token in self.given:
            return self.given[ask.token][0], ""
        if len(self.given) >= self.nodes[1] - 1:
            return None, self._all_here(ask)
        rank = len(self.given) + 1
        self.given[ask.token] = (rank, ask.host)
        return rank, ""

    def _join(self, ask: Ask, now: float) -> tuple[int | None, str]:
        if self.nodes[0] == self.nodes[1]:
            return None, f"{ask.host} asked to join a round, but the job's --nnodes is fixed: start it the same way"
        self.heard[ask.token] = now
        if ask.token in self.given:
            return (self.given[ask.token][0] if self.closed else None), ""
        if not self.closed:
            self.given[ask.token] = (0, ask.host)
            self.tick(now)
            return (self.given[ask.token][0] if self.closed else None), ""
        if ask.token not in self.waiting and len(self.waiting) >= self.nodes[1]:  # what machine 0 keeps is bounded
            del self.heard[ask.token]
            return None, (f"{len(self.waiting)} machines already wait to join a job of at most {self.nodes[1]} "
                          f"(--nnodes {nodes_text(self.nodes)}), and {ask.host} came too: is --nnodes right?")
        self.waiting.setdefault(ask.token, ask.host)
        if self.nnodes < self.nodes[1] and not self.over:
            self.failure = ""
            self._next(now)  # room for it: every machine starts again, with it
        return None, ""
