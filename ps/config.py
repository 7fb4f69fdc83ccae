"""Settings of the server role."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.scheduler.recovery import MAX_REPLICAS, mirror_rounds


@dataclass(frozen=True)
class ServerConfig:
    #: True: a round completes when every worker pushed (synchronous SGD). False: tensors that carry
    #: an optimizer are updated as each push arrives and pulls return the latest value (asynchronous).
    sync: bool = True
    #: survive a server killed mid-training: each server keeps its committed state in a file in
    #: /dev/shm, the launcher restarts a server that dies, and workers send it what is outstanding
    #: (docs/cluster.md, "Failures"); needs ps.sync = true
    recover: bool = False
    #: with ps.recover, how many times the launcher restarts servers in one job before giving up
    max_restarts: int = 3
    #: with ps.recover, how long the scheduler waits for a silent server's replacement before the
    #: job fails naming it (seconds)
    recover_timeout: float = 60.0
    #: on how many other hosts each server's committed state is mirrored (ps/mirror.py; needs ps.recover; up to
    #: 3, fewer where the servers span fewer hosts); 0: only in the server's own host's /dev/shm; -1: `sluice
    #: launch` chooses 1 (and turns ps.recover on) when the job's servers span several hosts and recovery can run
    #: (ps.sync, not --elastic), else 0
    replicas: int = -1
    #: with ps.replicas, mirror each chunk's state every this many rounds; a round's replies wait until the
    #: holder has the round this many before it, and every worker keeps (copies of) its pushes of that many
    #: rounds to replay to a server that takes over. 1: every round (with an optimizer on the servers, as the
    #: round's gradient, which the holder steps). More: fewer and cheaper mirrors, more memory on the workers.
    #: 0: `sluice launch` chooses from the worker count (4 to 16: within 10% of the servers' link bytes)
    mirror_every: int = 0
    #: with ps.replicas, how long a server waits for its mirrors' acknowledgements before it fails (seconds)
    mirror_timeout: float = 30.0
    #: with ps.replicas, let a server on the same host hold the mirror (tests on one machine only: such a
    #: mirror survives nothing the server's own state file does not)
    mirror_same_host: bool = False

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.recover_timeout <= 0:
            raise ValueError("ps.max_restarts must be 0 or more and ps.recover_timeout positive")
        if not -1 <= self.replicas <= MAX_REPLICAS or self.mirror_timeout <= 0:
            raise ValueError(f"ps.replicas must be -1 (chosen by the launcher) or 0..{MAX_REPLICAS}, got "
                             f"{self.replicas}, and ps.mirror_timeout positive")
        if not 0 <= self.mirror_every <= 64:
            raise ValueError(f"ps.mirror_every must be 1..64 rounds (0: chosen by the launcher), got "
                             f"{self.mirror_every}")
        if self.replicas > 0 and not self.recover:
            raise ValueError("ps.replicas mirrors the state that ps.recover keeps: set ps.recover = true too")

    @property
    def mirrored(self) -> bool:
        """Whether each server's state is mirrored on another host (-1 left unresolved by a launcher: no)."""
        return self.replicas > 0

    @property
    def mirror_rounds(self) -> int:
        """ps.mirror_every as used: 0 left unresolved by a launcher is MIRROR_EVERY."""
        return mirror_rounds(self.mirror_every)
