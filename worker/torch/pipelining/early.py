"""Whether a stage's backward sends its inputs' gradient before computing its weights': measured, per chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

#: backwards timed each way before the choice (the fastest of each counts: the first is often cold)
SAMPLES = 2


@dataclass
class EarlyInputs:
    """For one chunk of a stage with a stage before it, in GPipe or 1F1B: whether its next backward is
    split, the inputs' gradient computed and sent first and the weights' after it (the stage before
    then starts its own backward sooner), or run whole. The first SAMPLES backwards run whole, the next
    SAMPLES split, each timed from when its gradients were there; then split where that sends the
    inputs' gradient sooner than a whole backward ends by more than it lengthens the backward (two
    passes of the engine cost more than one where a chunk's graph is deep and its layers small).
    `forced`: always split (True) or never (False) instead."""

    forced: bool | None = None
    whole: list[float] = field(default_factory=list)
    #: split backwards: seconds until the inputs' gradient was sent, and in all
    to_inputs: list[float] = field(default_factory=list)
    split: list[float] = field(default_factory=list)
    #: the choice, once made: (split, seconds sooner, seconds longer)
    chosen: tuple[bool, float, float] | None = None

    def split_next(self) -> bool:
        if self.forced is not None:
            return self.forced
        if self.chosen is not None:
            return self.chosen[0]
        return len(self.whole) >= SAMPLES

    def record(self, split: bool, inputs_sent: float, ended: float) -> tuple[bool, float, float] | None:
        """A backward ran (split or whole): `inputs_sent` and `ended` seconds after its gradients were
        there. The choice when this one made it, else None."""
        if self.forced is not None or self.chosen is not None:
            return None
        if split:
            self.to_inputs.append(inputs_sent)
            self.split.append(ended)
        else:
            self.whole.append(ended)
        if len(self.split) < SAMPLES:
            return None
        whole = min(self.whole)
        sooner, longer = whole - min(self.to_inputs), min(self.split) - whole
        self.chosen = (sooner > longer, sooner, longer)
        return self.chosen
