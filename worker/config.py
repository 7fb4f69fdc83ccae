"""Settings of the worker role and its framework shims."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerConfig:
    #: "worker": servers only sum gradients and each worker runs its own optimizer (BytePS style);
    #: "server": servers apply the optimizer (SGD with momentum or Adam) and workers pull parameters.
    optimizer_on: str = "worker"
    #: with the optimizer on the workers: step() returns at once and each parameter is updated just
    #: before the next forward pass uses it, as soon as its summed gradient is back (ByteScheduler's
    #: overlap, which lets priorities shorten the step); false: step() waits for every gradient
    overlap_step: bool = True
    #: where tensor priorities come from: "forward" (the order the first forward pass uses the
    #: parameters, or the torch.fx graph when the model is given), "declaration" (the order the
    #: parameters were declared), or "none" (all equal: chunks are sent first come, first served)
    priority: str = "forward"
    #: per-name overrides, "PATTERN=PRIORITY" with shell-style patterns, e.g. ["fc*=0", "*.bias=5"];
    #: the first pattern that matches a parameter wins (0 is the most urgent)
    priority_overrides: tuple[str, ...] = field(default_factory=tuple)
    #: write the priority map in force to this JSON file (rank 0 only; empty: do not write)
    priority_file: str = ""
    #: print transport metrics (queueing delay per priority, bytes per channel) every N steps (0: only at the end)
    metrics_every: int = 0

    def __post_init__(self) -> None:
        if self.optimizer_on not in ("worker", "server"):
            raise ValueError(f"worker.optimizer_on must be 'worker' or 'server', got {self.optimizer_on!r}")
        if self.priority not in ("forward", "declaration", "none"):
            raise ValueError(f"worker.priority must be 'forward', 'declaration' or 'none', got {self.priority!r}")
        for override in self.priority_overrides:
            pattern, sep, level = override.rpartition("=")
            if not sep or not pattern or not level.strip().isdigit():
                raise ValueError(f"worker.priority_overrides entry {override!r} must look like 'PATTERN=PRIORITY', "
                                 "e.g. 'fc*=0'")
        if self.metrics_every < 0:
            raise ValueError(f"worker.metrics_every must be 0 or positive, got {self.metrics_every}")
