"""A standby scheduler's watch on the scheduler's port: a standby left with no job to take over leaves.

A standby (scheduler.standby) is stopped by the launcher when the job ends, and takes over when the
nodes rejoin it. A launcher SIGKILLed on a live host stops nothing, and a remote standby's stub
outlives its session (so that the loss of the launcher's host does not end the job): such a standby
would wait for ever. So while it stands by, it probes the scheduler's port each heartbeat interval
(a TCP connect, nothing sent; the scheduler's listening socket answers for it). Once the port has
been silent (refused or unanswered) for longer than `patience` and no node has rejoined — the nodes
notice a silent scheduler within heartbeat_timeout, so `standby_patience` gives them several times
that, and at least a minute, as a slow takeover must never find its standby gone — there is nothing
left to take over, and the standby leaves with an error that says so.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from urllib.parse import urlsplit


def standby_patience(heartbeat_timeout: float) -> float:
    """How long the scheduler's port may be silent, with no node rejoining, before a standby leaves."""
    return max(60.0, 4 * heartbeat_timeout)


def probe(endpoint: str, timeout: float) -> bool:
    """Whether something listens at `endpoint` ("tcp://host:port"), within `timeout` seconds."""
    parts = urlsplit(endpoint)
    if parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
            return True
    except OSError:
        return False


class SchedulerWatch:
    """Probes the scheduler's `endpoint` every `interval` seconds; `tick` says when the standby should leave."""

    def __init__(self, endpoint: str, interval: float, patience: float, now: float,
                 reach: Callable[[str, float], bool] = probe) -> None:
        self.endpoint, self.interval, self.patience, self._reach = endpoint, interval, patience, reach
        self._heard, self._next = now, now

    def tick(self, now: float, rejoined: bool) -> str | None:
        """Why this standby leaves now (its scheduler silent past `patience`, and nobody rejoined), or None."""
        if rejoined or now < self._next:
            return None
        self._next = now + self.interval
        if self._reach(self.endpoint, min(0.2, self.interval)):
            self._heard = now
            return None
        silent = now - self._heard
        if silent <= self.patience:
            return None
        return (f"the scheduler at {self.endpoint} has not answered for {silent:.0f} s and no node rejoined this "
                "standby: the job is gone (its launcher was killed?); nothing to take over, leaving")
