"""Page-locking a device-resident group's host buffer: pages of its own inside a larger allocation (pure)."""

from __future__ import annotations

import pytest

from sluice.worker.torch.device_hierarchy import own_pages


@pytest.mark.parametrize(
    ("address", "nbytes", "expected"),
    [
        (0, 1, (0, 4096)),  # aligned already: one page
        (4096, 4096, (0, 4096)),
        (4096 + 64, 4096, (4032, 4096)),  # the arena's 64-byte alignment: to the next page boundary
        (8192 - 1, 4097, (1, 8192)),
        (12288 + 4000, 0, (96, 4096)),  # an empty buffer still locks a page of its own
    ],
)
def test_a_buffer_gets_whole_pages_of_its_own(address: int, nbytes: int, expected: tuple[int, int]) -> None:
    offset, locked = own_pages(address, nbytes, 4096)
    assert (offset, locked) == expected
    assert (address + offset) % 4096 == 0 and locked >= nbytes
    assert offset + locked <= locked + 4096  # inside an allocation a page larger than the locked bytes
