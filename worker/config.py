"""Settings of the worker role and its framework shims."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    #: "worker": servers only sum gradients and each worker runs its own optimizer (BytePS style);
    #: "server": servers apply the optimizer (SGD with momentum or Adam) and workers pull parameters.
    optimizer_on: str = "worker"

    def __post_init__(self) -> None:
        if self.optimizer_on not in ("worker", "server"):
            raise ValueError(f"worker.optimizer_on must be 'worker' or 'server', got {self.optimizer_on!r}")
