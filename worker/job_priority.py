"""Job priorities on a shared network: a job's first rounds at the top ToS level, then MLFQ by bytes sent.

PIAS and Tiresias shorten the average job completion time without knowing job sizes by serving
least-attained-service first: a job starts at the top priority and is demoted as it sends more. Here
the level is a channel (each channel's sockets carry their own ToS mark, transport.tos; ZeroMQ sets
the mark per socket when it connects, so a live socket's mark cannot change: one channel per level),
the attained service is the bytes this worker has pushed, and the thresholds are cluster-wide
constants of the config. A job's workers push the same bytes, so they change level together, and no
job needs another job's state to mark its own traffic: the bottleneck's strict ToS bands arbitrate.
Strict bands can starve a demoted job while new jobs keep arriving, so, as Tiresias promotes a job
that has waited too long, a round slower than `promote_after_s` restarts the job's count at the top.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobsConfig:
    #: mark this job's traffic by what it has sent so far (channel 0 = the top level): its first
    #: `early_rounds` rounds at the top, then one level lower each time the bytes each worker has
    #: pushed pass a threshold; off: a tensor's channel follows its priority (docs/priority.md)
    priorities: bool = False
    #: rounds at the top level whatever the bytes (early feedback: a new job's first iterations)
    early_rounds: int = 10
    #: MiB pushed by a worker at which its job drops to the next level, ascending; the job has
    #: len + 1 levels, on channels 0..len (transport.channels must be at least that many)
    thresholds_mib: tuple[float, ...] = field(default_factory=lambda: (16.0, 256.0))
    #: a round slower than this many seconds (the job starved in a low band) puts the job back at the
    #: top level with its bytes counted from zero; 0: never
    promote_after_s: float = 30.0
    #: where each job's scheduler publishes its state for the others and `sluice jobs` (a directory
    #: private to this user; empty: /tmp/sluice-jobs-<uid>; scheduler/jobs_registry.py)
    registry_dir: str = ""
    #: "HOST:PORT" of the cluster's job registry, which every job's scheduler reports to and reads, so
    #: jobs on different hosts see each other (served by a scheduler on HOST; docs/aggregation.md "Job
    #: priorities"); empty: only this host's registry_dir
    registry: str = ""
    #: a scheduler on the registry's HOST serves it when its port is free (the first to bind it; when
    #: that job ends, another there takes over); false: only report to it
    registry_serve: bool = True
    #: a file (chmod 600) holding the cluster's registry secret, the same on every host: the registry
    #: admits only CURVE clients whose keys derive from it; empty: unauthenticated, which is allowed
    #: only with transport.curve = false
    registry_secret_file: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "thresholds_mib", tuple(self.thresholds_mib))  # JSON gives a list
        host, colon, port = self.registry.rpartition(":")
        if self.registry and (not colon or not host or not port.isdigit() or not 0 < int(port) < 65536):
            raise ValueError(f"jobs.registry must be HOST:PORT (e.g. node1:29450), got {self.registry!r}")
        if self.early_rounds < 0:
            raise ValueError(f"jobs.early_rounds must be 0 or positive, got {self.early_rounds}")
        if any(t <= 0 for t in self.thresholds_mib) or list(self.thresholds_mib) != sorted(set(self.thresholds_mib)):
            raise ValueError(f"jobs.thresholds_mib must be positive and strictly ascending, got "
                             f"{list(self.thresholds_mib)}")
        if self.promote_after_s < 0:
            raise ValueError(f"jobs.promote_after_s must be 0 (never) or positive, got {self.promote_after_s}")

    @property
    def levels(self) -> int:
        return len(self.thresholds_mib) + 1


class JobLevel:
    """One worker's level in its job's multi-level feedback queue; pure (the caller gives the time)."""

    def __init__(self, config: JobsConfig, channels: int) -> None:
        if config.levels > channels:
            raise ValueError(f"jobs.thresholds_mib gives {config.levels} levels, but the transport has "
                             f"{channels} channels: set transport.channels = {config.levels} or drop thresholds")
        self.config = config
        self._thresholds = [int(t * (1 << 20)) for t in config.thresholds_mib]
        self.rounds = 0
        self.attained = 0
        self.promotions = 0
        self._round_started: float | None = None

    @property
    def level(self) -> int:
        if self.rounds <= self.config.early_rounds:
            return 0
        return bisect.bisect_right(self._thresholds, self.attained)

    def on_push(self, round_: int, nbytes: int, now: float) -> int:
        """Count a push of `nbytes` in round `round_` (of any tensor); the level (channel) it goes on."""
        if round_ > self.rounds:  # the job's next round begins
            started, self._round_started = self._round_started, now
            promote = self.config.promote_after_s
            if started is not None and promote and now - started > promote:
                self.attained = 0
                self.promotions += 1
            self.rounds = round_
        level = self.level
        self.attained += nbytes
        return level

    def report(self) -> list[int]:
        """[level, bytes attained, rounds], for the scheduler's job registry (read from another thread)."""
        return [self.level, self.attained, self.rounds]
