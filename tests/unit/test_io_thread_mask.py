"""Which ZeroMQ I/O threads each channel's connections may use (transport.io_threads; zmq.AFFINITY masks)."""

from __future__ import annotations

import pytest

from sluice.transport.zmq_guard import io_thread_mask


@pytest.mark.parametrize(
    ("io_threads", "masks"),
    [
        (2, [0b1, 0b10, 0b10]),  # channel 0 alone on thread 0; bulk on thread 1
        (3, [0b1, 0b110, 0b110]),  # the others share threads 1 and 2, each connection to the less busy
        (4, [0b1, 0b1110, 0b1110]),
    ],
)
def test_channel_0_has_a_thread_to_itself_and_the_others_share_the_rest(io_threads: int, masks: list[int]) -> None:
    assert [io_thread_mask(channel, io_threads) for channel in range(3)] == masks
