"""Which stage and replica each worker runs, and its neighbours: literal tables."""

from __future__ import annotations

import pytest

from sluice.worker.pipeline.layout import StagePlace


def test_eight_workers_in_two_replicas_of_four_stages() -> None:
    table = [(p.stage, p.replica, p.previous, p.next, p.group) for p in (StagePlace(r, 8, 4) for r in range(8))]
    assert table == [
        (0, 0, None, 1, [0, 4]),
        (1, 0, 0, 2, [1, 5]),
        (2, 0, 1, 3, [2, 6]),
        (3, 0, 2, None, [3, 7]),
        (0, 1, None, 5, [0, 4]),
        (1, 1, 4, 6, [1, 5]),
        (2, 1, 5, 7, [2, 6]),
        (3, 1, 6, None, [3, 7]),
    ]


def test_one_stage_is_data_parallel_only() -> None:
    place = StagePlace(2, 3, 1)
    assert (place.stage, place.replica, place.first, place.last, place.previous, place.next) == (0, 2, True, True,
                                                                                                   None, None)
    assert place.group == [0, 1, 2] and place.replicas == 3


def test_rank_of() -> None:
    place = StagePlace(5, 6, 3)
    assert (place.stage, place.replica) == (2, 1)
    assert [place.rank_of(s) for s in range(3)] == [3, 4, 5]
    assert place.rank_of(0, replica=0) == 0
    with pytest.raises(ValueError, match=r"stage 3 is not one of 0\.\.2"):
        place.rank_of(3)


@pytest.mark.parametrize(("rank", "size", "stages", "message"), [
    (0, 6, 4, "6 workers cannot form pipelines of 4 stages"),
    (3, 3, 1, "out of range"),
    (0, 2, 0, "out of range"),
])
def test_refused(rank: int, size: int, stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StagePlace(rank, size, stages)
