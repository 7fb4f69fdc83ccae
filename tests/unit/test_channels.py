"""Channel -> priority map and packet marks: which channel carries a priority, which ToS it gets."""

from __future__ import annotations

import pytest

from sluice.errors import SluiceError
from sluice.transport.config import BULK_TOS, NORMAL_TOS, URGENT_TOS, TransportConfig
from sluice.worker.config import WorkerConfig
from sluice.worker.tensors import parse_plan

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("channels", "levels", "table"),
    [
        # channel of priorities 0..9 when 10 tensors are declared
        (3, (), [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]),
        (1, (), [0] * 10),
        (2, (), [0] * 5 + [1] * 5),
        (3, (1, 5), [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]),
        (2, (0,), [0] + [1] * 9),
        (4, (0, 1, 2), [0, 1, 2, 3, 3, 3, 3, 3, 3, 3]),
    ],
)
def test_channel_for_priority(channels: int, levels: tuple[int, ...], table: list[int]) -> None:
    config = TransportConfig(channels=channels, channel_levels=levels)
    assert [config.channel_for(priority, 10) for priority in range(10)] == table


@pytest.mark.parametrize(
    ("settings", "table"),
    [
        # channel of (priority, bytes) for 10 declared tensors: (0, 4 MiB) (0, 4 MiB + 1) (4, 1 KiB) (9, 64 MiB) (1, 0)
        ({}, [0, 2, 1, 2, 0]),
        ({"bulk_bytes": 0}, [0, 0, 1, 2, 0]),  # off: by priority alone
        ({"bulk_bytes": 512}, [2, 2, 2, 2, 0]),
        ({"channel_levels": (0, 5)}, [0, 2, 1, 2, 1]),  # bulk goes last whatever the levels say
        ({"channels": 2}, [0, 1, 0, 1, 0]),
        ({"channels": 1}, [0, 0, 0, 0, 0]),
    ],
)
def test_bulk_tensors_ride_the_last_channel_whatever_their_priority(settings: dict[str, object],
                                                                    table: list[int]) -> None:
    config = TransportConfig(**settings)  # type: ignore[arg-type]
    tensors = [(0, 4 << 20), (0, (4 << 20) + 1), (4, 1024), (9, 64 << 20), (1, 0)]
    assert [config.channel_for(priority, 10, nbytes) for priority, nbytes in tensors] == table


def test_with_one_priority_bulk_and_small_tensors_share_a_channel() -> None:
    """worker.priority = "none" gives every tensor priority 0: first come, first served, on one connection."""
    config = TransportConfig()
    assert [config.channel_for(0, 1, nbytes) for nbytes in (0, 1024, 64 << 20)] == [0, 0, 0]


def test_a_plan_puts_each_tensor_on_its_channel_by_priority_and_size() -> None:
    """The scheduler's PLAN table: [key, name, shape, dtype, priority, [[chunk, offset, elements, server]]]."""
    plan = [
        [0, "conv.weight", [64, 3, 3, 3], "float32", 0, [[0, 0, 1728, 0]]],
        [1, "fc.weight", [2048, 2048], "float32", 1, [[0, 0, 1 << 21, 0], [1, 1 << 21, 1 << 21, 1]]],
        [2, "fc.bias", [2048], "float16", 2, [[0, 0, 2048, 1]]],
        [3, "head.weight", [10, 2048], "float32", 3, [[0, 0, 20480, 0]]],
    ]
    tensors = parse_plan(plan, {}, TransportConfig())
    # 4 priorities in 3 even bands: 0, 0, 1, 2; the 16 MiB fc.weight is bulk whatever its priority
    assert {name: t.channel for name, t in tensors.items()} == {
        "conv.weight": 0, "fc.weight": 2, "fc.bias": 1, "head.weight": 2}
    assert tensors["fc.weight"].numel == 1 << 22
    assert parse_plan(plan, {}, TransportConfig(bulk_bytes=0))["fc.weight"].channel == 0


def test_a_plan_with_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(SluiceError, match="malformed PLAN"):
        parse_plan([[0, "x", [4], "complex256", 0, [[0, 0, 4, 0]]]], {}, TransportConfig())


def test_priorities_beyond_the_declared_count_ride_the_last_channel() -> None:
    assert TransportConfig(channels=3).channel_for(50, 10) == 2
    assert TransportConfig(channels=3).channel_for(0, 0) == 0


@pytest.mark.parametrize(
    ("settings", "tos"),
    [
        ({}, (URGENT_TOS, NORMAL_TOS, BULK_TOS)),  # pfifo_fast bands 0, 1, 2
        ({"channels": 1}, (NORMAL_TOS,)),
        ({"channels": 2}, (URGENT_TOS, BULK_TOS)),
        ({"channels": 4}, (URGENT_TOS, NORMAL_TOS, NORMAL_TOS, BULK_TOS)),
        ({"marks": False}, ()),
        ({"tos": (0xB8, 0x00, 0x20)}, (0xB8, 0x00, 0x20)),
        ({"tos": (0xB8, 0x00, 0x20), "marks": False}, (0xB8, 0x00, 0x20)),  # explicit marks win
    ],
)
def test_packet_marks_per_channel(settings: dict[str, object], tos: tuple[int, ...]) -> None:
    assert TransportConfig(**settings).channel_tos() == tos  # type: ignore[arg-type]


def test_default_marks_land_in_the_three_pfifo_fast_bands() -> None:
    """Linux: priority = ip_tos2prio[(tos & 0x1e) >> 1]; pfifo_fast's priomap sends it to a band."""
    tos2prio = [0, 1, 0, 0, 2, 2, 2, 2, 6, 6, 6, 6, 4, 4, 4, 4]
    priomap = [1, 2, 2, 2, 1, 2, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    bands = [priomap[tos2prio[(tos & 0x1E) >> 1]] for tos in TransportConfig().channel_tos()]
    assert bands == [0, 1, 2]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"channel_levels": (3,)}, "one value per channel but the last"),
        ({"channel_levels": (5, 5)}, "rise"),
        ({"channel_levels": (-1, 5)}, "non-negative"),
        ({"so_priority": (1, 2)}, "so_priority needs one value per channel"),
        ({"aging_ms": 0.0}, "aging_ms"),
        ({"chunk_bytes": 100}, "chunk_bytes"),
        ({"inflight_bytes": -1}, "inflight_bytes"),
        ({"bulk_bytes": -1}, "bulk_bytes"),
    ],
)
def test_bad_channel_settings_are_refused(settings: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TransportConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"priority": "random"}, "worker.priority"),
        ({"priority_overrides": ("fc*",)}, "PATTERN=PRIORITY"),
        ({"priority_overrides": ("fc*=high",)}, "PATTERN=PRIORITY"),
        ({"metrics_every": -1}, "metrics_every"),
    ],
)
def test_bad_priority_settings_are_refused(settings: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        WorkerConfig(**settings)  # type: ignore[arg-type]


def test_so_priority_is_refused_with_what_to_do_where_libzmq_cannot_set_it() -> None:
    import zmq

    try:
        probe = zmq.Context.instance().socket(zmq.DEALER)
        probe.setsockopt(zmq.PRIORITY, 0)
        probe.close(linger=0)
    except (zmq.ZMQError, AttributeError):
        with pytest.raises(ValueError, match="derives each socket's priority from its ToS"):
            TransportConfig(so_priority=(6, 0, 1))
    else:  # a libzmq built with its draft API: the setting is taken
        assert TransportConfig(so_priority=(6, 0, 1)).so_priority == (6, 0, 1)
