"""Settings of the scheduler role and the control plane every node shares."""

from __future__ import annotations

from dataclasses import dataclass

#: standby schedulers a job may have (each is an idle process until it takes over)
MAX_STANDBYS = 4
#: DSCP CS6, "network control": the class switches serve first, for the traffic that steers the network
NETWORK_CONTROL_TOS = 0xC0


@dataclass(frozen=True)
class SchedulerConfig:
    #: seconds between heartbeats a node sends to the scheduler
    heartbeat_interval: float = 1.0
    #: a node (or the scheduler) silent this long is declared lost; the job ends naming it
    heartbeat_timeout: float = 8.0
    #: all servers and workers must have registered within this many seconds
    rendezvous_timeout: float = 120.0
    #: a declaration, barrier or pull waits at most this long before failing with a named error
    op_timeout: float = 120.0
    #: the port the scheduler listens on; 0: one the OS picks (`sluice launch` hands it to the others).
    #: `sluice node` sets it from --scheduler, so pods started by Kubernetes find the scheduler there
    port: int = 0
    #: standby schedulers: N (1..MAX_STANDBYS) starts N, each on another host where there are enough (on this
    #: one when the job has one host); the first takes over when the scheduler falls silent (nodes rejoin it,
    #: scheduler/standby.py), the next when that one does; 0: none; -1: one when the job spans several hosts
    standby: int = -1
    #: the port the standby listens on; 0: one the OS picks. An elastic job re-formed in place starts its
    #: standby again on the same port, so that every node still has its endpoint
    standby_port: int = 0
    #: the ToS byte of the scheduler's messages when transport.marks is on (default DSCP CS6, network
    #: control): a switch of aggregation trees, or a node's heartbeat answer, must not queue behind a
    #: link's data. A node's messages to the scheduler carry its channel 0's mark (transport.tos)
    control_tos: int = NETWORK_CONTROL_TOS

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ValueError("scheduler.heartbeat_interval must be positive and below heartbeat_timeout")
        for name in ("rendezvous_timeout", "op_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"scheduler.{name} must be positive")
        if not -1 <= self.standby <= MAX_STANDBYS:
            raise ValueError(f"scheduler.standby must be -1 (one when the job spans several hosts), 0 (none) or a "
                             f"count up to {MAX_STANDBYS}, got {self.standby}")
        if not 0 <= self.control_tos <= 255 or self.control_tos & 0x03:
            raise ValueError(f"scheduler.control_tos must be a ToS byte with the two ECN bits clear, got "
                             f"{self.control_tos}")
        for name in ("port", "standby_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"scheduler.{name} must be 0 (the OS picks one) or a TCP port up to 65535, "
                                 f"got {getattr(self, name)}")
