"""Settings of the server role."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.scheduler.recovery import MIRROR_EVERY


@dataclass(frozen=True)
class ServerConfig:
    #: True: a round completes when every worker pushed (synchronous SGD). False: tensors that carry
    #: an optimizer are updated as each push arrives and pulls return the latest value (asynchronous).
    sync: bool = True
    #: survive a server killed mid-training: each server keeps its committed state in a file in
    #: /dev/shm, the launcher restarts a server that dies, and workers send it what is outstanding
    #: (docs/cluster.md, "Failures"); needs ps.sync = true and no aggregators
    recover: bool = False
    #: with ps.recover, how many times the launcher restarts servers in one job before giving up
    max_restarts: int = 3
    #: with ps.recover, how long the scheduler waits for a silent server's replacement before the
    #: job fails naming it (seconds)
    recover_timeout: float = 60.0
    #: with ps.recover, on how many other hosts each server's committed state is mirrored (ps/mirror.py); 0: only
    #: in the server's own host's /dev/shm
    replicas: int = 0
    #: with ps.replicas, mirror each chunk's state every this many rounds; a round's replies wait until the
    #: holder has the round this many before it, and every worker keeps (copies of) its pushes of that many
    #: rounds to replay to a server that takes over. 1: every round (with an optimizer on the servers, as the
    #: round's gradient, which the holder steps). More: fewer and cheaper mirrors, more memory on the workers
    mirror_every: int = MIRROR_EVERY
    #: with ps.replicas, how long a server waits for its mirror's acknowledgement before it fails (seconds)
    mirror_timeout: float = 30.0
    #: with ps.replicas, let a server on the same host hold the mirror (tests on one machine only: such a
    #: mirror survives nothing the server's own state file does not)
    mirror_same_host: bool = False

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.recover_timeout <= 0:
            raise ValueError("ps.max_restarts must be 0 or more and ps.recover_timeout positive")
        if self.replicas not in (0, 1) or self.mirror_timeout <= 0:
            raise ValueError(f"ps.replicas must be 0 or 1 (more replicas are not built yet), got {self.replicas}, "
                             "and ps.mirror_timeout positive")
        if not 1 <= self.mirror_every <= 64:
            raise ValueError(f"ps.mirror_every must be 1..64 rounds, got {self.mirror_every}")
        if self.replicas and not self.recover:
            raise ValueError("ps.replicas mirrors the state that ps.recover keeps: set ps.recover = true too")
