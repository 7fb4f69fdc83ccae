"""What machine 0 keeps for the launchers of a job run one per machine: their ranks and the job's starts (pure).

torchrun's c10d rendezvous numbers the machines of a job itself, so the usual `srun torchrun --nnodes 4
--rdzv-backend c10d --rdzv-endpoint HEAD:29400 ...` gives no machine a rank, and its --max-restarts starts every
machine's workers again when one fails. Here machine 0 (the machine with the rendezvous address, which runs the
scheduler) answers the other launchers (launch/machine_zero.py) from a JobBook:
- `rank`: ranks 1..N-1 in the order machines ask, one per launcher (a random token, so a request sent again gets
  the same rank); one machine too many is refused, saying so;
- `start` and `failed`: the job's current start (0, then 1 after the first restart, ...), which machine 0 has
  started (`ready`: the others start theirs after it, so no worker meets the last start's scheduler), and
  whether the job is `over` (a start failed with no restart left). A launcher whose processes failed reports its
  start; the first report of the current start begins the next one, later ones change nothing.
Every request names the asker's --nnodes, --nproc-per-node and --max-restarts, which must be machine 0's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from sluice.transport.request_server import json_within

PROTOCOL = 1
MAX_REQUEST_BYTES = 1024
MAX_REPLY_BYTES = 1024
OPS = ("rank", "start", "failed")


@dataclass(frozen=True)
class Ask:
    op: str  # rank | start | failed
    token: str  # random, per launcher
    host: str  # the asking machine's name, for machine 0's log and its errors
    nnodes: int
    nproc: int
    restarts: int
    start: int = 0  # failed: the start whose processes failed


@dataclass(frozen=True)
class Answer:
    rank: int | None  # the asker's rank (op rank), else None
    error: str  # why machine 0 refuses ("" when it does not)
    start: int  # the job's current start
    ready: int  # the latest start machine 0 has started
    over: bool  # a start failed with no restart left: every machine ends


def new_ask(op: str, nnodes: int, nproc: int, restarts: int, token: str = "", start: int = 0) -> Ask:
    return Ask(op, token or os.urandom(16).hex(), os.uname().nodename[:253] or "?", nnodes, nproc, restarts, start)


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
    raw = _json_object(data, MAX_REQUEST_BYTES, {"v", "op", "token", "host", "nnodes", "nproc", "restarts", "start"})
    op, token, host = raw["op"], raw["token"], raw["host"]
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}")
    if type(token) is not str or not 16 <= len(token) <= 64 or not all(c in "0123456789abcdef" for c in token):
        raise ValueError("a token must be 16 to 64 hex digits")
    if type(host) is not str or not 0 < len(host) <= 253 or not host.isprintable():
        raise ValueError("a host name must be 1 to 253 printable characters")
    return Ask(str(op), token, host, _count(raw, "nnodes", 2, 65536), _count(raw, "nproc", 1, 4096),
               _count(raw, "restarts", 0, 10**6), _count(raw, "start", 0, 10**6))


def encode_answer(answer: Answer) -> bytes:
    body = asdict(answer)
    body["error"] = answer.error[:MAX_REPLY_BYTES // 2]
    return json.dumps({"v": PROTOCOL, **body}).encode()


def parse_answer(data: bytes) -> Answer:
    """Machine 0's answer, or ValueError."""
    raw = _json_object(data, MAX_REPLY_BYTES, {"v", "rank", "error", "start", "ready", "over"})
    error, over = raw["error"], raw["over"]
    if type(error) is not str or type(over) is not bool:
        raise ValueError("an answer's error is a string and over a boolean")
    rank = None if raw["rank"] is None else _count(raw, "rank", 1, 65535)
    return Answer(rank, error, _count(raw, "start", 0, 10**6), _count(raw, "ready", 0, 10**6), over)


class JobBook:
    """Machine 0's ranks handed out and the job's starts (not thread-safe: the service holds a lock)."""

    def __init__(self, nnodes: int, nproc: int, restarts: int) -> None:
        self.nnodes, self.nproc, self.restarts = nnodes, nproc, restarts
        self.given: dict[str, tuple[int, str]] = {}  # token -> (rank, host)
        self.start = self.ready = 0
        self.over = False

    def answer(self, ask: Ask) -> Answer:
        """What machine 0 says to `ask`, after taking it in."""
        error, rank = self._mismatch(ask), None
        if not error and ask.op == "rank":
            rank, error = self._rank(ask)
        elif not error and ask.op == "failed":
            self.failed(ask.start)
        return Answer(rank, error, self.start, self.ready, self.over)

    def failed(self, start: int) -> None:
        """A machine's processes of `start` failed: the next start begins, or with no restart left the job is over."""
        if start == self.start:
            if self.start < self.restarts:
                self.start += 1
            else:
                self.over = True

    def _mismatch(self, ask: Ask) -> str:
        ours, theirs = (self.nnodes, self.nproc, self.restarts), (ask.nnodes, ask.nproc, ask.restarts)
        if ours == theirs:
            return ""
        return (f"machine 0 runs --nnodes {ours[0]} --nproc-per-node {ours[1]} --max-restarts {ours[2]}, and "
                f"{ask.host} was started with --nnodes {theirs[0]} --nproc-per-node {theirs[1]} --max-restarts "
                f"{theirs[2]}: start every machine with the same")

    def _rank(self, ask: Ask) -> tuple[int | None, str]:
        if ask.token in self.given:
            return self.given[ask.token][0], ""
        if len(self.given) >= self.nnodes - 1:
            hosts = ", ".join(f"{rank} {host}" for rank, host in sorted(self.given.values()))
            return None, (f"the job's {self.nnodes} machines are all here (machine 0 and {hosts}), and {ask.host} "
                          "asked for a rank too: is --nnodes right, or does a machine run `sluice launch` twice?")
        rank = len(self.given) + 1
        self.given[ask.token] = (rank, ask.host)
        return rank, ""
