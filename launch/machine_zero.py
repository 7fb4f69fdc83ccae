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
from typing import Any

import zmq

from sluice.launch.node_ranks import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    Answer,
    Ask,
    JobBook,
    encode_answer,
    encode_ask,
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


def rank_keys(secret: bytes) -> JobKeys:
    """The service's CURVE keys, derived from the job secret as the job's members' are."""
    return JobKeys(secret, (SERVER_NAME, CLIENT_NAME))


class RankService:
    """Machine 0's service at address:port until close(); `said` hears each rank handed out and each refusal (on
    the service's thread). Machine 0's own launcher reads and moves the starts through `failed` and `started`."""

    def __init__(self, address: str, port: int, keys: JobKeys | None, book: JobBook,
                 said: Callable[[str], None]) -> None:
        self.book, self._said, self._lock = book, said, threading.Lock()
        self._server = RequestServer(SERVER_NAME, address, port, keys, MAX_REQUEST_BYTES, self._answer, log,
                                     "machine 0")
        self._server.start()

    @property
    def refused(self) -> int:
        return self._server.refused

    def state(self) -> tuple[int, bool]:
        """(the job's current start, whether it is over)."""
        with self._lock:
            return self.book.start, self.book.over

    def failed(self, start: int) -> tuple[int, bool]:
        """Machine 0's processes of `start` failed: (the job's start now, whether it is over)."""
        with self._lock:
            self.book.failed(start)
            return self.book.start, self.book.over

    def started(self, start: int) -> None:
        """Machine 0 started its processes (the scheduler first) of `start`: the others may start theirs."""
        with self._lock:
            self.book.ready = max(self.book.ready, start)

    def _answer(self, peer: str, data: bytes, now: float) -> bytes:
        ask = parse_ask(data)
        with self._lock:
            known = ask.token in self.book.given
            answer = self.book.answer(ask)
        if answer.error:
            self._said(f"refused {ask.host}: {answer.error}")
        elif answer.rank is not None and not known:
            self._said(f"machine {answer.rank} of {self.book.nnodes}: {ask.host}")
        return encode_answer(answer)

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
                until: Callable[[Answer], bool] = lambda answer: True) -> Answer:
        """Machine 0's first answer to `op` that satisfies `until`, asking again every ASK_EVERY_S without an answer
        and every PACE_S with one that does not (an answer to an earlier request may come late, and a machine
        waiting for machine 0 to move on keeps asking); RankError when it refuses or none came within timeout_s."""
        ask = Ask(op, self._ask.token, self._ask.host, self._ask.nnodes, self._ask.nproc, self._ask.restarts, start)
        began = noted = time.monotonic()
        while (waited := time.monotonic() - began) < timeout_s:
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
                time.sleep(PACE_S)
            if time.monotonic() - noted >= WAITING_NOTE_S:
                noted = time.monotonic()
                say(f"still waiting for machine 0 at {self.host}:{self.port} ({noted - began:.0f} s)")
        raise RankError(f"machine 0 at {self.host}:{self.port} did not answer within {timeout_s:.0f} s: is `sluice "
                        f"launch --nnodes {ask.nnodes}` running on {self.host}, with the same --secret-file (or "
                        "transport.curve) as here?")

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class Starts:
    """The job's starts as one launcher sees them (--max-restarts with a launcher per machine): machine 0's own
    through its service, another's through its line to machine 0. Calls that wait run in a thread."""

    def __init__(self, service: RankService | None, zero: MachineZero | None, timeout_s: float,
                 say: Callable[[str], None]) -> None:
        assert service is not None or zero is not None, "machine 0's service, or a line to it"
        self.service, self.zero, self.timeout_s, self.say = service, zero, timeout_s, say

    async def ready(self, start: int, interrupted: asyncio.Future[int]) -> bool:
        """Wait until machine 0 started `start` (at once on machine 0); False when the job is over or `interrupted`
        came first; RankError when machine 0 does not answer."""
        if self.zero is None or start == 0:
            return True
        zero = self.zero
        asked: asyncio.Future[Answer] = asyncio.ensure_future(asyncio.to_thread(
            zero.request, "start", self.timeout_s, self.say, 0, lambda a: a.ready >= start or a.over))
        waited: list[asyncio.Future[Any]] = [asked, interrupted]
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        if not asked.done():  # the thread gives up within ASK_EVERY_S: the launcher's loop must not wait for more
            zero.stopped.set()
            await asyncio.wait([asked])
            return False
        return not asked.result().over

    def started(self, start: int) -> None:
        if self.service is not None:
            self.service.started(start)

    async def now(self, known: tuple[int, bool]) -> tuple[int, bool]:
        """(the job's current start, whether it is over); `known` when machine 0 does not answer within NOW_S (its
        processes gone with it, this machine's fail by themselves on the lost scheduler)."""
        if self.service is not None:
            return self.service.state()
        assert self.zero is not None
        try:
            answer = await asyncio.to_thread(self.zero.request, "start", NOW_S, lambda text: None)
        except RankError:
            return known
        return answer.start, answer.over

    async def failed(self, start: int) -> tuple[int, bool]:
        """This machine's processes of `start` failed: (the start to run next, whether the job is over instead)."""
        if self.service is not None:
            return self.service.failed(start)
        assert self.zero is not None
        answer = await asyncio.to_thread(self.zero.request, "failed", FAILED_S, self.say, start,
                                         lambda a: a.start > start or a.over)
        return answer.start, answer.over
