"""Which pipeline stage and replica each worker runs (pure): stage = rank % P, replica = rank // P.

Why this order: a launcher fills each host's slots with consecutive ranks, so the P stages of one
replica sit on as few hosts as possible. Activations and their gradients cross between neighbouring
stages for every micro-batch, on the critical path; the replicas of a stage exchange gradients once a
step, which overlaps with the rest of the backward. So the heavy, latency-bound traffic stays in a
host (shared memory) and only the once-a-step traffic crosses the network, as Megatron-LM and
DeepSpeed place pipeline stages (innermost after tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlace:
    """Where one worker sits in a job of `size` workers cut into `stages` pipeline stages."""

    rank: int
    size: int
    stages: int

    def __post_init__(self) -> None:
        if self.stages < 1 or self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size} workers, {self.stages} stages: out of range")
        if self.size % self.stages:
            raise ValueError(f"{self.size} workers cannot form pipelines of {self.stages} stages: the number of "
                             f"workers must be a multiple of the stages (e.g. sluice launch -n "
                             f"{self.stages * max(1, self.size // self.stages)})")

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def replicas(self) -> int:
        return self.size // self.stages

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def previous(self) -> int | None:
        """The rank of the stage before this one in the same replica (None on the first stage)."""
        return None if self.first else self.rank - 1

    @property
    def next(self) -> int | None:
        """The rank of the stage after this one in the same replica (None on the last stage)."""
        return None if self.last else self.rank + 1

    @property
    def group(self) -> list[int]:
        """The ranks of every replica of this stage, by replica: they average this stage's gradients."""
        return [replica * self.stages + self.stage for replica in range(self.replicas)]

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """The rank running `stage` of `replica` (by default this worker's)."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} is not one of 0..{self.stages - 1}")
        return (self.replica if replica is None else replica) * self.stages + stage
