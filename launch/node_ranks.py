"""Machine ranks for launchers started without --node-rank: machine 0 hands out 1..N-1 in the order machines ask.

torchrun's c10d rendezvous numbers the machines of a job itself, so the usual `srun torchrun --nnodes 4
--rdzv-backend c10d --rdzv-endpoint HEAD:29400 ...` gives no machine a rank. Here machine 0 is the one with the
rendezvous address (it runs the scheduler); its launcher serves ranks on the port just above the scheduler's
channels (RankService), and every other launcher without --node-rank asks it before starting anything
(`ask_rank`). A launcher asks with a random token, so a request sent again (machine 0 not up yet, a reply
lost) gets the same rank, and with its --nnodes and --nproc-per-node, which must be machine 0's. The requests
ride transport/request_server.py: with CURVE (the default) only a process holding the job secret gets one
through, and a malformed request is refused and counted, with no reply.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import zmq

from sluice.transport.auth import JobKeys
from sluice.transport.request_server import RequestServer, dealer

log = logging.getLogger("sluice.launch")

PROTOCOL = 1
#: the member names the service's keys derive from (transport/auth.py), apart from the job's own members
SERVER_NAME, CLIENT_NAME = "node-ranks", "node-ranks-client"
MAX_REQUEST_BYTES = 1024
MAX_REPLY_BYTES = 1024
#: a launcher asks again this often until machine 0 answers (its launcher may start later)
ASK_EVERY_S = 1.0
#: and says it is still waiting this often
WAITING_NOTE_S = 10.0


class RankError(Exception):
    """No rank for this machine: machine 0 refused (saying why), or did not answer in time."""


def rank_keys(secret: bytes) -> JobKeys:
    """The service's CURVE keys, derived from the job secret as the job's members' are."""
    return JobKeys(secret, (SERVER_NAME, CLIENT_NAME))


@dataclass(frozen=True)
class Ask:
    token: str  # random, per launcher: the same launcher asking again gets the same rank
    host: str  # the asking machine's name, for machine 0's log and its errors
    nnodes: int
    nproc: int


def encode_ask(ask: Ask) -> bytes:
    return json.dumps({"v": PROTOCOL, **asdict(ask)}).encode()


def _json_object(data: bytes, limit: int, fields: set[str]) -> dict[str, object]:
    if len(data) > limit:
        raise ValueError(f"{len(data)} bytes, over {limit}")
    try:
        raw = json.loads(data)
    except ValueError:
        raise ValueError("not JSON") from None
    if type(raw) is not dict or set(raw) != fields or raw["v"] != PROTOCOL:
        raise ValueError(f"not a rank message of protocol {PROTOCOL} ({', '.join(sorted(fields))})")
    return raw


def parse_ask(data: bytes) -> Ask:
    """A launcher's request, or ValueError saying what is wrong with it."""
    raw = _json_object(data, MAX_REQUEST_BYTES, {"v", "token", "host", "nnodes", "nproc"})
    token, host, nnodes, nproc = raw["token"], raw["host"], raw["nnodes"], raw["nproc"]
    if type(token) is not str or not 16 <= len(token) <= 64 or not all(c in "0123456789abcdef" for c in token):
        raise ValueError("a token must be 16 to 64 hex digits")
    if type(host) is not str or not 0 < len(host) <= 253 or not host.isprintable():
        raise ValueError("a host name must be 1 to 253 printable characters")
    if type(nnodes) is not int or type(nproc) is not int or not 1 < nnodes <= 65536 or not 0 < nproc <= 4096:
        raise ValueError("nnodes must be 2 to 65536 and nproc 1 to 4096")
    return Ask(token, host, nnodes, nproc)


def encode_answer(rank: int | None, error: str) -> bytes:
    return json.dumps({"v": PROTOCOL, "rank": rank, "error": error[:MAX_REPLY_BYTES // 2]}).encode()


def parse_answer(data: bytes) -> tuple[int | None, str]:
    """(rank, "") or (None, machine 0's reason); ValueError for anything else."""
    raw = _json_object(data, MAX_REPLY_BYTES, {"v", "rank", "error"})
    rank, error = raw["rank"], raw["error"]
    if type(error) is not str or not ((type(rank) is int and rank > 0 and not error) or (rank is None and error)):
        raise ValueError("an answer holds a rank above 0 or an error")
    return rank, error


class RankBook:
    """Machine 0's ranks handed out: 1..N-1 in the order machines ask, one per token."""

    def __init__(self, nnodes: int, nproc: int) -> None:
        self.nnodes, self.nproc = nnodes, nproc
        self.given: dict[str, tuple[int, str]] = {}  # token -> (rank, host)

    def give(self, ask: Ask) -> tuple[int | None, str]:
        """(rank, "") for this launcher, or (None, what to change)."""
        if (ask.nnodes, ask.nproc) != (self.nnodes, self.nproc):
            return None, (f"machine 0 runs --nnodes {self.nnodes} --nproc-per-node {self.nproc}, and {ask.host} "
                          f"was started with --nnodes {ask.nnodes} --nproc-per-node {ask.nproc}: start every "
                          "machine with the same")
        if ask.token in self.given:
            return self.given[ask.token][0], ""
        if len(self.given) >= self.nnodes - 1:
            hosts = ", ".join(f"{rank} {host}" for rank, host in sorted(self.given.values()))
            return None, (f"the job's {self.nnodes} machines are all here (machine 0 and {hosts}), and {ask.host} "
                          "asked for a rank too: is --nnodes right, or does a machine run `sluice launch` twice?")
        rank = len(self.given) + 1
        self.given[ask.token] = (rank, ask.host)
        return rank, ""


class RankService:
    """Machine 0's rank service at address:port until close(); `said` hears each rank handed out (its thread)."""

    def __init__(self, address: str, port: int, keys: JobKeys | None, nnodes: int, nproc: int,
                 said: Callable[[str], None]) -> None:
        self.book, self._said = RankBook(nnodes, nproc), said
        self._server = RequestServer(SERVER_NAME, address, port, keys, MAX_REQUEST_BYTES, self._answer, log,
                                     "machine ranks")
        self._server.start()

    @property
    def refused(self) -> int:
        return self._server.refused

    def _answer(self, peer: str, data: bytes, now: float) -> bytes:
        ask = parse_ask(data)
        known = ask.token in self.book.given
        rank, error = self.book.give(ask)
        if rank is not None and not known:
            self._said(f"machine {rank} of {self.book.nnodes}: {ask.host}")
        elif error:
            self._said(f"refused a rank to {ask.host}: {error}")
        return encode_answer(rank, error)

    def close(self) -> None:
        self._server.close()


def ask_rank(host: str, port: int, keys: JobKeys | None, ask: Ask, timeout_s: float,
             say: Callable[[str], None]) -> int:
    """This machine's rank from machine 0's service at host:port, asking every ASK_EVERY_S; RankError when it
    refuses or has not answered within timeout_s."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, host, port, keys, (CLIENT_NAME, SERVER_NAME), MAX_REPLY_BYTES, immediate=True)
    started = noted = time.monotonic()
    say(f"asking machine 0 at {host}:{port} for this machine's rank")
    try:
        while (waited := time.monotonic() - started) < timeout_s:
            with contextlib.suppress(zmq.Again):  # not connected yet: machine 0's launcher may not be up
                sock.send(encode_ask(ask), zmq.NOBLOCK)
            if sock.poll(int(min(ASK_EVERY_S, timeout_s - waited) * 1000)):
                try:
                    rank, error = parse_answer(sock.recv())
                except ValueError as exc:  # only machine 0's launcher could send it: say so, ask again
                    log.warning("a malformed answer from machine 0 at %s:%d (%s); asking again", host, port, exc)
                    continue
                if rank is None:
                    raise RankError(f"machine 0 ({host}) gives this machine no rank: {error}")
                return rank
            if time.monotonic() - noted >= WAITING_NOTE_S:
                noted = time.monotonic()
                say(f"still waiting for machine 0 at {host}:{port} ({noted - started:.0f} s)")
        raise RankError(f"machine 0 at {host}:{port} did not give this machine a rank within {timeout_s:.0f} s: is "
                        f"`sluice launch --nnodes {ask.nnodes}` running on {host}, with the same --secret-file (or "
                        "transport.curve) as here?")
    finally:
        sock.close(linger=0)
        ctx.term()


def new_ask(nnodes: int, nproc: int) -> Ask:
    return Ask(os.urandom(16).hex(), os.uname().nodename[:253] or "?", nnodes, nproc)
