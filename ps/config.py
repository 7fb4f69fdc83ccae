"""Settings of the server role."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.recover_timeout <= 0:
            raise ValueError("ps.max_restarts must be 0 or more and ps.recover_timeout positive")
