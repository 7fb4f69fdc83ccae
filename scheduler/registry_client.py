"""A scheduler's link to the cluster's job registry (report, take the table, serve it when nobody does); `query`.

Nothing here blocks the scheduler's loop: a report is sent without waiting, the reply is read at a
later tick, and a registry that has not answered for `deadline_s` is unreachable: logged once (and
once more when it answers again); the job runs on, its levels are its own (worker/job_priority.py),
and its per-host file is published all along. A scheduler on the registry's HOST with
jobs.registry_serve on tries to bind PORT at start and whenever the registry is unreachable, so
when the serving job ends another job's scheduler there takes over; the table comes back within a
report period, as every scheduler sends its whole entry each time.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from typing import Any

import zmq

from sluice.scheduler.jobs_registry import JobState
from sluice.scheduler.registry_service import (
    CLIENT_NAME,
    MAX_REPLY_BYTES,
    SERVED_STALE_S,
    SERVER_NAME,
    RegistryServer,
    Request,
    encode_request,
    load_keys,
    local_addresses,
    parse_reply,
    split_endpoint,
)
from sluice.transport.auth import JobKeys
from sluice.transport.request_server import dealer

log = logging.getLogger("sluice.scheduler")

#: a registry that has not answered for this long is unreachable (a reply normally takes milliseconds)
REPLY_DEADLINE_S = 2.0
_WITHDRAW_LINGER_MS = 500


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, keys: JobKeys | None,
            immediate: bool) -> zmq.Socket[bytes]:
    return dealer(ctx, host, port, keys, (CLIENT_NAME, SERVER_NAME), MAX_REPLY_BYTES, immediate)


class RegistryLink:
    """One scheduler's reports to the registry at `endpoint` ("HOST:PORT"), and the table it gets back."""

    def __init__(self, endpoint: str, keys: JobKeys | None, serve: bool, deadline_s: float = REPLY_DEADLINE_S,
                 stale_s: float = SERVED_STALE_S) -> None:
        self.endpoint = endpoint
        self.host, self.port = split_endpoint(endpoint)
        self.keys, self.serve, self.deadline_s, self.stale_s = keys, serve, deadline_s, stale_s
        self.server: RegistryServer | None = None
        #: the cluster's jobs at the last reply, and how many messages the registry had refused then
        self.jobs: list[JobState] = []
        self.refused = 0
        self.reachable: bool | None = None  # None: no answer yet, nor a deadline passed
        self._seq = 0
        self._waiting_since: float | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = _dealer(self._ctx, self.host, self.port, keys, immediate=True)
        #: where it may serve the registry, resolved once (a lookup may take seconds; the loop must not)
        self._addresses = local_addresses(self.host) if serve else []
        self.try_serve()

    def try_serve(self) -> None:
        """Serve the registry if it is to be served from this host and its port is free."""
        if not self.serve or self.server is not None:
            return
        for address in self._addresses:
            try:
                self.server = RegistryServer(address, self.port, self.keys, self.stale_s)
            except zmq.ZMQError as exc:
                if exc.errno == errno.EADDRINUSE:  # another scheduler serves it (or ends and frees it soon)
                    return
                continue  # not an address of this host
            log.info("serving the cluster's job registry at %s (jobs.registry_serve)", self.endpoint)
            return
        self.serve = False  # none of HOST's addresses is this host's: it is served elsewhere

    def report(self, state: JobState, now: float) -> None:
        """Send this job's entry; the reply is read by a later receive()."""
        self._seq += 1
        if self._waiting_since is None:
            self._waiting_since = now
        if self.reachable is False:
            self.try_serve()
        with contextlib.suppress(zmq.Again):  # not connected (yet, or any more): the deadline decides
            self._sock.send(encode_request(Request(self._seq, "report", state)), zmq.NOBLOCK)

    def receive(self, now: float) -> list[JobState] | None:
        """The cluster's jobs if a reply came since the last call, else None; notes a missed deadline."""
        fresh: list[JobState] | None = None
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                seq, jobs, refused = parse_reply(data)
            except ValueError as exc:  # only the registry's holder could send it: say so, take nothing
                log.warning("the job registry at %s sent a malformed reply (%s); ignored", self.endpoint, exc)
                continue
            if 0 < seq <= self._seq:
                fresh, self.jobs, self.refused = jobs, jobs, refused
        if fresh is not None:
            self._waiting_since = None
            if self.reachable is False:
                log.info("the job registry at %s answers again", self.endpoint)
            self.reachable = True
        elif (self._waiting_since is not None and now - self._waiting_since > self.deadline_s
              and self.reachable is not False):
            self.reachable = False
            log.warning("the job registry at %s has not answered for %.0f s; this job runs on and keeps its "
                        "entry in this host's registry (`sluice jobs`). Is a scheduler with jobs.registry_serve "
                        "running on %s, and does jobs.registry_secret_file hold the same secret as there?",
                        self.endpoint, self.deadline_s, self.host)
            self.try_serve()
        return fresh

    def withdraw(self, job: str) -> None:
        """Remove this job's entry (sent on close; the registry drops it anyway when it stops reporting)."""
        self._seq += 1
        with contextlib.suppress(zmq.Again):
            self._sock.send(encode_request(Request(self._seq, "withdraw", job=job)), zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=_WITHDRAW_LINGER_MS)  # a withdraw just sent still goes out
        if self.server is not None:
            self.server.close()
        self._ctx.term()


def open_link(jobs: dict[str, Any], curve: bool) -> RegistryLink | None:
    """The link [jobs] asks for; None (logged) when jobs.registry is unset or its secret cannot be read."""
    endpoint = str(jobs.get("registry", ""))
    if not endpoint:
        return None
    try:
        keys = load_keys(str(jobs.get("registry_secret_file", "")), curve)
        return RegistryLink(endpoint, keys, bool(jobs.get("registry_serve", True)))
    except (OSError, ValueError, zmq.ZMQError) as exc:
        log.error("this job is not in the cluster's job registry %s: %s; it runs on and keeps its entry in this "
                  "host's registry", endpoint, exc)
        return None


def query(endpoint: str, keys: JobKeys | None, timeout_s: float = 5.0) -> tuple[list[JobState], int]:
    """The cluster's jobs and the registry's count of refused messages (`sluice jobs --registry`).

    Raises TimeoutError, saying what to check, when no reply comes within timeout_s."""
    host, port = split_endpoint(endpoint)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _dealer(ctx, host, port, keys, immediate=False)  # queued until the connection is up
    try:
        sock.send(encode_request(Request(1, "list")), zmq.NOBLOCK)
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the job registry at {endpoint} within {timeout_s:.0f} s: is a job "
                               f"running whose scheduler serves it on {host} (jobs.registry_serve), and is the "
                               "registry secret file the one its jobs use (--registry-secret-file)?")
        _, jobs, refused = parse_reply(sock.recv())
        return jobs, refused
    finally:
        sock.close(linger=0)
        ctx.term()
