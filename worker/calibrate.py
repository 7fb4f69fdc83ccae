"""The calibration a worker runs at start: probe its servers, then choose chunk size and in-flight bound.

Probes are PROBE messages that servers answer at once with an empty PROBE_REPLY, so a burst's time
is the time to move its bytes to the servers (in parallel, as training does) plus one round trip.
The choice itself is `scheduler.calibration`; this module only measures. It takes well under a
second: about 30 MiB of probes on a 1 Gbit/s link, a few milliseconds on loopback.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import numpy as np

from sluice.errors import SluiceError
from sluice.scheduler.calibration import (
    LOCAL_MAX_CHUNK,
    MAX_INFLIGHT,
    Limits,
    choose_chunk,
    choose_inflight,
    inflight_candidates,
)
from sluice.transport.base import Transport
from sluice.transport.wire import Kind, Message

log = logging.getLogger("sluice.worker")

_BURST_BYTES = 8 << 20
_PROBE_BYTES = 256 << 10
_SMALL_PROBES = 64


class Calibrator:
    def __init__(self, transport: Transport, node_id: int, servers: list[str], channel: int, timeout: float) -> None:
        self._transport, self._node_id, self._servers = transport, node_id, servers
        self._channel, self._timeout = channel, timeout
        self._cond = threading.Condition()
        self._replies = 0
        self._seq = 0
        self._burst_after = 0
        self._buffer = transport.alloc(LOCAL_MAX_CHUNK, np.dtype(np.uint8))  # registered: no copy to local peers

    def on_reply(self, msg: Message) -> None:
        with self._cond:
            if msg.round > self._burst_after:  # a late answer to an earlier probe does not count
                self._replies += 1
                self._cond.notify_all()

    def _until_answered(self) -> None:
        """Probe every server until it answers: a server admitted at the same moment as this worker
        may not know of it yet, and refuses (and logs) probes from strangers until it does."""
        deadline = time.monotonic() + self._timeout
        for server in self._servers:
            while True:
                try:
                    self._burst(1, 0, [server], wait=0.5)
                    break
                except SluiceError:
                    if time.monotonic() > deadline:
                        raise

    def run(self, chunk_bytes: int = 0, inflight_bytes: int = 0, local: bool = False) -> tuple[Limits, str]:
        """Measure and choose; a fixed (non-zero) chunk size or bound is kept as given. `local`: every
        server is on this host (shared memory, no network queue).

        Returns the limits and a line saying what was measured, for the log.
        """
        started = time.monotonic()
        self._until_answered()
        rtt = statistics.median(self._burst(1, 0) for _ in range(5))
        per_message = self._burst(_SMALL_PROBES, 0) / _SMALL_PROBES
        self._transport.set_inflight(MAX_INFLIGHT)
        bandwidth = max(_BURST_BYTES / self._burst(_BURST_BYTES // _PROBE_BYTES, _PROBE_BYTES) for _ in range(2))
        chunk = chunk_bytes or choose_chunk(bandwidth, per_message, local)
        inflight = inflight_bytes
        if not inflight:
            trials: list[tuple[int, float]] = []
            count = max(_BURST_BYTES // chunk, 8)
            for bound in inflight_candidates(chunk):
                self._transport.set_inflight(bound)
                trials.append((bound, count * chunk / self._burst(count, chunk)))
                chosen = choose_inflight(trials, bandwidth, local)
                if chosen is not None:
                    inflight = chosen
                    break
            else:
                inflight = max(trials, key=lambda trial: trial[1])[0]
        self._transport.set_inflight(inflight)
        self._transport.stats(reset=True)  # the job's metrics start after the probes
        measured = (
            f"{bandwidth / 1e6:.0f} MB/s to {len(self._servers)} server(s), round trip {rtt * 1e3:.2f} ms, "
            f"{per_message * 1e6:.0f} us per message; took {time.monotonic() - started:.2f} s"
        )
        return Limits(chunk, inflight), measured

    def _burst(self, count: int, nbytes: int, servers: list[str] | None = None, wait: float = 0.0) -> float:
        """Send `count` probes of `nbytes` round-robin over the servers; seconds until all are answered."""
        servers = servers or self._servers
        with self._cond:
            self._replies = 0
            self._burst_after = self._seq
        started = time.monotonic()
        payload = self._buffer[:nbytes] if nbytes else None
        for index in range(count):
            self._seq += 1
            msg = Message(Kind.PROBE, sender=self._node_id, round=self._seq, priority=1 << 20)
            if payload is not None:
                msg.dtype, msg.shape, msg.payload = "uint8", (nbytes,), payload
            self._transport.send(servers[index % len(servers)], self._channel, msg)
        deadline = started + (wait or self._timeout)
        with self._cond:
            while self._replies < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SluiceError(
                        f"calibration: {count - self._replies} of {count} probes to the servers "
                        f"({', '.join(servers)}) had no answer after {wait or self._timeout:.1f} s"
                    )
                self._cond.wait(left)
        return max(time.monotonic() - started, 1e-6)
