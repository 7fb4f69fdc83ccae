"""Machine 0's launcher serving the others (ranks, the job's starts: launch/node_ranks.py), and their side of it.

The service listens on the port after the scheduler's channels, on a ROUTER behind the transport's guard
(transport/request_server.py): with CURVE (the default) only a launcher holding the job secret gets a request
through, and a malformed request is refused and counted, with no reply. The other launchers ask with a DEALER,
again every ASK_EVERY_S until machine 0 answers (its launcher may start after theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from sluice.launch.node_ranks import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    Answer,
    Ask,
    JobBook,
    cause_text,
    encode_answer,
    encode_ask,
    nodes_text,
    parse_answer,
    parse_ask,
)
from sluice.transport.auth import JobKeys
from sluice.transport.request_server import RequestServer, dealer

log = logging.getLogger("sluice.launch")

#: the member names the service's keys derive from (transport/auth.py), apart from the job's own members
SERVER_NAME, CLIENT_NAME = "node-ranks", "node-ranks-client"
#: a launcher asks again this often until machine 0 answers
ASK_EVERY_S = 1.0
#: and after an answer that does not yet say what it waits for, this often
PACE_S = 0.2
#: how long a launcher watching its processes waits for machine 0 to say which start the job is in, and how long
#: one whose processes failed waits for its answer (machine 0's launcher gone: the job is over)
NOW_S, FAILED_S = 3.0, 15.0
#: and says it is still waiting this often
WAITING_NOTE_S = 10.0


class RankError(Exception):
    """Machine 0 refused (saying why), or did not answer in time."""


@dataclass(frozen=True)
class Place:
    """A machine's place in one start of the job."""

    start: int
    rank: int
    nnodes: int
    #: the starts that failed before this one (torchrun's restart count)
    failures: int
    #: the job is over (a start failed with no restart left): no place
    over: bool = False


def rank_keys(secret: bytes) -> JobKeys:
    """The service's CURVE keys, derived from the job secret as the job's members' are."""
    return JobKeys(secret, (SERVER_NAME, CLIENT_NAME))


class RankService:
    """Machine 0's service at address:port until close(); `said` hears each rank handed out and each refusal (on
    the service's thread). Machine 0's own launcher reads and moves the starts through `failed` and `started`."""

    def __init__(self, address: str, port: int, keys: JobKeys | None, book: JobBook,
                 said: Callable[[str], None]) -> None:
        self.book, self._said, self._lock = book, said, threading.Lock()
        #: the latest start whose machines were said (-1: none yet)
        self._told = -1
        self._server = RequestServer(SERVER_NAME, address, port, keys, MAX_REQUEST_BYTES, self._answer, log,
                                     "machine 0")
        self._server.start()

    @property
    def refused(self) -> int:
        return self._server.refused

    def state(self) -> tuple[int, bool]:
        """(the job's current start, whether it is over)."""
        with self._lock:
            self._settle(time.monotonic())
            return self.book.start, self.book.over

    def failure(self) -> str:
        """The cause of the failure that began the current start or ended the job ("" when none did)."""
        with self._lock:
            return self.book.failure

    def place(self) -> Place | None:
        """Machine 0's place in the current start once its machines are settled (an elastic range's round closed),
        else None; `over` in it when the job is over."""
        with self._lock:
            book = self.book
            self._settle(time.monotonic())
            return Place(book.start, 0, book.nnodes, book.failures, book.over) if book.nnodes or book.over else None

    def waiting(self, waited: float) -> str:
        """What the start machine 0 waits for has, to say after `waited` seconds."""
        with self._lock:
            book = self.book
            low, high = book.nodes
            call = (f"; it begins at {high}, or in {max(0.0, book.deadline - time.monotonic()):.0f} s"
                    if book.deadline is not None else f"; it begins once {low} have joined")
            return (f"start {book.start + 1} waits for machines ({waited:.0f} s): {1 + len(book.given)} joined of "
                    f"--nnodes {nodes_text(book.nodes)}{call}")

    def failed(self, start: int, cause: str = "") -> tuple[int, bool]:
        """Machine 0's processes of `start` failed (`cause`: which, and how): (the job's start now, whether it is
        over)."""
        with self._lock:
            self.book.failed(start, time.monotonic(), cause)
            self._settle(time.monotonic())
            return self.book.start, self.book.over

    def started(self, start: int) -> None:
        """Machine 0 started its processes (the scheduler first) of `start`: the others may start theirs."""
        with self._lock:
            self.book.ready = max(self.book.ready, start)

    def _answer(self, peer: str, data: bytes, now: float) -> bytes:
        ask = parse_ask(data)
        with self._lock:
            book = self.book
            known = ask.token in book.given or ask.token in book.waiting
            answer = book.answer(ask, time.monotonic())
            if answer.error:
                self._said(f"refused {ask.host}: {answer.error}")
            elif ask.op == "rank" and not known:
                self._said(f"machine {answer.rank} of {book.nnodes}: {ask.host}")
            elif ask.op == "join" and not known:
                self._said(f"{ask.host} joins start {book.start + 1} ({1 + len(book.given)} machines of --nnodes "
                           f"{nodes_text(book.nodes)})" if ask.token in book.given else
                           f"{ask.host} waits: the job already runs on --nnodes {nodes_text(book.nodes)}'s most")
            self._settle(time.monotonic())
        return encode_answer(answer)

    def _settle(self, now: float) -> None:
        """Under the lock: the book's round closes on time, and each start's machines are said once."""
        self.book.tick(now)
        book = self.book
        if book.start > self._told and book.nnodes and not book.over and book.nodes[0] != book.nodes[1]:
            self._told = book.start
            machines = ", ".join(f"{rank} {host}" for rank, host in sorted(book.given.values()))
            self._said(f"start {book.start + 1}: {book.nnodes} machines (0 here" + (f", {machines})" if machines
                                                                                     else ")"))

    def close(self) -> None:
        self._server.close()


class MachineZero:
    """Another launcher's line to machine 0's service at host:port."""

    def __init__(self, host: str, port: int, keys: JobKeys | None, ask: Ask) -> None:
        self.host, self.port, self._ask = host, port, ask
        #: set: a request waiting in another thread gives up within ASK_EVERY_S (the launcher is stopping)
        self.stopped = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = dealer(self._ctx, host, port, keys, (CLIENT_NAME, SERVER_NAME), MAX_REPLY_BYTES, immediate=True)

    def request(self, op: str, timeout_s: float, say: Callable[[str], None], start: int = 0,
                until: Callable[[Answer], bool] = lambda answer: True, silent_s: float | None = None,
                cause: str = "") -> Answer:
        """Machine 0's first answer to `op` that satisfies `until`, asking again every ASK_EVERY_S without an answer
        and every PACE_S with one that does not (an answer to an earlier request may come late, and a machine
        waiting for machine 0 to move on keeps asking); RankError when it refuses, when none came within timeout_s,
        or when machine 0 has not answered at all within `silent_s` (a shorter wait for a longer request). `cause`:
        a failure's (cause_text)."""
        ask = Ask(op, self._ask.token, self._ask.host, self._ask.min_nodes, self._ask.max_nodes, self._ask.nproc,
                  self._ask.restarts, start, cause_text(cause))
        began = noted = time.monotonic()
        answered = False
        unheard_s = min(timeout_s, silent_s) if silent_s else timeout_s
        while (waited := time.monotonic() - began) < (timeout_s if answered else unheard_s):
            if self.stopped.is_set():
                raise RankError("this launcher is stopping")
            with contextlib.suppress(zmq.Again):  # not connected yet: machine 0's launcher may not be up
                self._sock.send(encode_ask(ask), zmq.NOBLOCK)
            if self._sock.poll(int(min(ASK_EVERY_S, timeout_s - waited) * 1000)):
                try:
                    answer = parse_answer(self._sock.recv())
                except ValueError as exc:  # only machine 0's launcher could send it: say so, ask again
                    log.warning("a malformed answer from machine 0 at %s:%d (%s); asking again", self.host,
                                self.port, exc)
                    continue
                if answer.error:
                    raise RankError(f"machine 0 ({self.host}) refuses this machine: {answer.error}")
                if until(answer):
                    return answer
                answered = True
                time.sleep(PACE_S)
            if time.monotonic() - noted >= WAITING_NOTE_S:
                noted = time.monotonic()
                say(f"machine 0 at {self.host}:{self.port} answers; still waiting for this machine's start "
                    f"({noted - began:.0f} s)" if answered else
                    f"still waiting for machine 0 at {self.host}:{self.port} ({noted - began:.0f} s)")
        given = nodes_text((ask.min_nodes, ask.max_nodes))
        if answered:
            raise RankError(f"machine 0 at {self.host}:{self.port} answers, but this machine's start did not come "
                            f"within {timeout_s:g} s" + (" (torchrun's join_timeout: --rdzv-conf join_timeout=SECONDS)"
                                                         if op == "join" else ""))
        raise RankError(f"machine 0 at {self.host}:{self.port} did not answer within {unheard_s:.0f} s: is `sluice "
                        f"launch --nnodes {given}` running on {self.host}, with the same --secret-file (or "
                        "transport.curve) as here?")

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class Starts:
    """The job's starts as one launcher sees them (--max-restarts, or an elastic range of machines, with a launcher per
    machine): machine 0's own through its service, another's through its line to machine 0. Calls that wait for
    machine 0 run in a thread."""

    def __init__(self, service: RankService | None, zero: MachineZero | None, timeout_s: float,
                 say: Callable[[str], None], join_s: float = 600.0) -> None:
        """`timeout_s`: how long a machine waits for machine 0 to start its processes; `join_s`: for an elastic
        range's round to close (torchrun's join_timeout)."""
        assert service is not None or zero is not None, "machine 0's service, or a line to it"
        self.service, self.zero, self.timeout_s, self.say, self.join_s = service, zero, timeout_s, say, join_s
        #: as machine 0 last said: the cause of the failure that began the current start or ended the job
        self.failure = ""

    async def place(self, start: int, fixed: Place | None, interrupted: asyncio.Future[int]) -> Place | None:
        """This machine's place in start `start` once machine 0 started its own processes of it: `fixed` (--nnodes N:
        the same ranks in every start, each start after a failure), or for an elastic range the place its round gave
        in the job's current start. None when the job is over or `interrupted` came first; RankError when machine 0
        does not answer, or no round closed within the join timeout."""
        if fixed is not None:
            if self.zero is None or start == 0:
                return fixed
            answer = await self._ask("start", self.timeout_s, 0, lambda a: a.ready >= start or a.over, interrupted)
            return None if answer is None or answer.over else fixed
        if self.zero is not None:
            answer = await self._ask("join", self.join_s, 0,
                                     lambda a: (a.rank is not None and a.ready >= a.start) or a.over, interrupted,
                                     silent_s=self.timeout_s)  # a machine 0 that never answers: not join_timeout
            if answer is None or answer.over or answer.rank is None:
                return None
            return Place(answer.start, answer.rank, answer.nnodes, answer.failures)
        service = self.service
        assert service is not None
        began = noted = time.monotonic()
        deadline = began + self.join_s
        while (place := service.place()) is None:
            if time.monotonic() - noted >= WAITING_NOTE_S:
                noted = time.monotonic()
                self.say(service.waiting(noted - began))
            if time.monotonic() > deadline:
                book = service.book
                raise RankError(f"start {book.start + 1} did not begin within {self.join_s:g} s (torchrun's "
                                f"join_timeout, --rdzv-conf join_timeout=SECONDS): {1 + len(book.given)} of at least "
                                f"{book.nodes[0]} machines (--nnodes {nodes_text(book.nodes)}) joined")
            await asyncio.wait([interrupted], timeout=PACE_S)
            if interrupted.done():
                return None
        return None if place.over else place

    async def _ask(self, op: str, timeout_s: float, start: int, until: Callable[[Answer], bool],
                   interrupted: asyncio.Future[int], silent_s: float | None = None) -> Answer | None:
        """Machine 0's answer to `op` satisfying `until`, asked in a thread; None when `interrupted` came first."""
        zero = self.zero
        assert zero is not None
        asked: asyncio.Future[Answer] = asyncio.ensure_future(asyncio.to_thread(
            zero.request, op, timeout_s, self.say, start, until, silent_s))
        waited: list[asyncio.Future[Any]] = [asked, interrupted]
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        if not asked.done():  # the thread gives up within ASK_EVERY_S: the launcher's loop must not wait for more
            zero.stopped.set()
            await asyncio.wait([asked])
            return None
        return asked.result()

    def started(self, start: int) -> None:
        if self.service is not None:
            self.service.started(start)

    async def now(self, known: tuple[int, bool]) -> tuple[int, bool]:
        """(the job's current start, whether it is over); `known` when machine 0 does not answer within NOW_S (its
        processes gone with it, this machine's fail by themselves on the lost scheduler)."""
        if self.service is not None:
            state = self.service.state()
            self.failure = self.service.failure()  # read after the state: at least as new as it
            return state
        assert self.zero is not None
        try:
            answer = await asyncio.to_thread(self.zero.request, "start", NOW_S, lambda text: None)
        except RankError:
            return known
        self.failure = answer.failure
        return answer.start, answer.over

    async def failed(self, start: int, cause: str = "") -> tuple[int, bool]:
        """This machine's processes of `start` failed (`cause`: which, and how): (the start to run next, whether the
        job is over instead)."""
        if self.service is not None:
            return self.service.failed(start, cause)
        assert self.zero is not None
        answer = await asyncio.to_thread(self.zero.request, "failed", FAILED_S, self.say, start,
                                         lambda a: a.start > start or a.over, None, cause)
        return answer.start, answer.over
