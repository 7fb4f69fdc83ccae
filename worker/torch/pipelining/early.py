"""Whether a stage's backwards send their inputs' gradient before computing their weights': measured by whole steps."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

#: the first training steps, not counted: the job is still warming (allocations, first calls, lanes)
COLD = 3
#: the training steps after those that try each way, whole (False) or split (True): in runs, as a step
#: that changes the way is not timed (it begins where the last of the other way ended, which a split
#: backward's weights' half moves), in an order that favours neither as a warming job gets faster (ABBA)
TRIALS = (False,) * 3 + (True,) * 6 + (False,) * 3


@dataclass
class EarlyInputs:
    """For the backwards of a stage with a stage before it, in GPipe, 1F1B or interleaved 1F1B: whether
    a step's are split, each inputs' gradient computed and sent first and its weights' after it (the
    stage before then starts its own backward sooner), or run whole. After its first COLD steps the stage runs
    TRIALS, timing each step, then keeps the way whose steps took less (the median). Whole steps are what
    count: a split costs a second pass of autograd's engine and a walk of the graph, which a deep graph
    of small layers pays more for than it gains, and on more stages than cores the extra CPU time
    delays the other stages. Every stage tries the same way in the same step, so each times the
    pipeline as it would run. `forced`: always split (True) or never (False) instead."""

    forced: bool | None = None
    #: seconds of the trial steps, each way
    whole: list[float] = field(default_factory=list)
    split: list[float] = field(default_factory=list)
    #: the choice, once made
    chosen: bool | None = None
    steps: int = 0

    def split_next(self) -> bool:
        """Whether the next training step splits its backwards."""
        if self.forced is not None:
            return self.forced
        if self.chosen is not None:
            return self.chosen
        trial = self.steps - COLD
        return 0 <= trial < len(TRIALS) and TRIALS[trial]

    def record(self, split: bool, seconds: float) -> bool | None:
        """A training step ran (its backwards split or not) in `seconds`; the choice when this step made
        it, else None."""
        if self.forced is not None or self.chosen is not None:
            return None
        self.steps += 1
        if self.steps <= COLD:
            return None
        if self.steps > COLD + 1 and TRIALS[self.steps - COLD - 2] == split:  # not the first of a run
            (self.split if split else self.whole).append(seconds)
        if self.steps < COLD + len(TRIALS):
            return None
        self.chosen = statistics.median(self.split) < statistics.median(self.whole)
        return self.chosen
