"""Stages in a ring, for interleaved schedules: the last worker's chunk feeds the first worker's next chunk.

With V chunks per worker (chunk c of worker r being virtual stage c * P + r), activations go from
worker P - 1 back to worker 0 between chunks, and gradients from worker 0 to worker P - 1: each
worker's neighbours are those of a ring. `RingPlace` is a StagePlace whose stage before the first is
the last and whose stage after the last is the first (within the replica); `RingExchange` is a
StageExchange over it, whose direct lanes each ring neighbour offers the next (with two stages, only
the first offers: the two are each other's before and after, and one lane serves both ways). The
messages name their micro-batch as chunk * M + m, the chunk being that of the earlier of the two
virtual stages they pass between, so the exchange's tables keep every chunk's apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.transport import lane as lanes
from sluice.transport.base import Transport
from sluice.worker.pipeline.exchange import Neighbours, StageExchange
from sluice.worker.pipeline.layout import StagePlace
from sluice.worker.pipeline.links import Links


class RingPlace(StagePlace):
    """A StagePlace whose stages wrap round: the first's stage before is the last, the last's after the first."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stages < 2:
            raise ValueError("stages in a ring need at least two of them: one stage would send to itself")

    @property
    def previous(self) -> int:
        return self.rank_of((self.stage - 1) % self.stages)

    @property
    def next(self) -> int:
        return self.rank_of((self.stage + 1) % self.stages)


class RingExchange(StageExchange):
    def __init__(self, transport: Transport, place: RingPlace, workers: Neighbours, timeout: float,
                 channel_for: Callable[[int], int], *, direct: bool = True, **options: Any) -> None:
        """As StageExchange (the same options), over a ring of stages."""
        super().__init__(transport, place, workers, timeout, channel_for, direct=False, **options)
        here = workers.hosts[place.rank]
        local = {rank: workers.names[rank] for rank in (place.previous, place.next) if workers.hosts[rank] == here}
        offers = place.next in local and (place.stages > 2 or place.next > place.rank)
        if direct and lanes.AVAILABLE and local:
            self.links = Links(transport, place.rank, local, place.next if offers else None, channel_for(0))
