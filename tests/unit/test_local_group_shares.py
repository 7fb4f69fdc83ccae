"""How a local group cuts a flat tensor in shares, and where its store lives (pure)."""

from __future__ import annotations

import pytest

from sluice.worker.local_group import store_path
from sluice.worker.topology import share_bounds


@pytest.mark.parametrize(("length", "parts", "padded", "bounds"), [
    (12, 3, 12, [(0, 4), (4, 8), (8, 12)]),
    (10, 3, 12, [(0, 4), (4, 8), (8, 10)]),  # the last share shorter: the padding is nobody's
    (1, 4, 4, [(0, 1), (1, 1), (1, 1), (1, 1)]),  # fewer elements than ranks: empty shares
    (0, 2, 0, [(0, 0), (0, 0)]),
    (7, 1, 7, [(0, 7)]),  # a host of one worker: its share is everything
])
def test_local_group_shares_are_equal_and_cover_the_tensor(length: int, parts: int, padded: int,
                                                          bounds: list[tuple[int, int]]) -> None:
    assert share_bounds(length, parts) == (padded, bounds)


def test_local_group_shares_refuse_nonsense_and_the_store_takes_only_a_tag() -> None:
    with pytest.raises(ValueError, match="cannot cut 5 elements in 0 shares"):
        share_bounds(5, 0)
    assert store_path("0123456789abcdef", 2, 3, "/dev/shm") == "/dev/shm/sluice-state-0123456789abcdef-local-2-3"
    with pytest.raises(ValueError, match="a state tag is 16 hex digits"):
        store_path("../../etc/passwd", 0, 0)
