"""Per-tensor routes of hybrid jobs (pure): patterns, modes, and auto's share of bytes for the servers."""

from __future__ import annotations

import pytest
import torch

from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.torch.fusion import choose_routes, ps_share

NAMED = [(name, torch.zeros(n)) for name, n in
         [("embed.weight", 4000), ("fc1.weight", 2000), ("fc2.weight", 1000), ("fc1.bias", 20), ("fc2.bias", 10)]]


@pytest.mark.parametrize(
    ("workers", "servers", "share"),
    [(1, 0, 0.0), (4, 0, 0.0), (1, 1, 1.0), (4, 2, 0.6), (4, 4, 2 * 4 * 3 / (16 + 16 - 8)), (8, 1, 14 / 70)],
)
def test_auto_share_follows_the_bandwidth_balance(workers: int, servers: int, share: float) -> None:
    assert ps_share(workers, servers) == pytest.approx(share)


def test_no_servers_means_allreduce_for_everything() -> None:
    routes = choose_routes(NAMED, CollectiveConfig(mode="ps"), ["a", "b"], [])
    assert set(routes.values()) == {"allreduce"}


def test_auto_on_one_host_uses_allreduce_since_servers_add_no_link() -> None:
    assert set(choose_routes(NAMED, CollectiveConfig(), ["h"] * 4, ["h", "h"]).values()) == {"allreduce"}


def test_auto_sends_the_largest_tensors_to_server_only_hosts() -> None:
    # 4 worker hosts, 2 server hosts: 60% of 7030 floats' bytes -> embed (4000) to the servers, not fc1 too
    routes = choose_routes(NAMED, CollectiveConfig(), ["w0", "w1", "w2", "w3"], ["s0", "s1"])
    assert routes == {"embed.weight": "ps", "fc1.weight": "allreduce", "fc2.weight": "allreduce",
                      "fc1.bias": "allreduce", "fc2.bias": "allreduce"}
    # one worker host, one server host: everything to the servers
    assert set(choose_routes(NAMED, CollectiveConfig(), ["w"], ["s"]).values()) == {"ps"}


def test_patterns_win_over_the_mode() -> None:
    settings = CollectiveConfig(mode="ps", allreduce_patterns=("*.bias",), ps_patterns=("fc2.*",))
    routes = choose_routes(NAMED, settings, ["h"], ["h"])
    assert routes == {"embed.weight": "ps", "fc1.weight": "ps", "fc2.weight": "ps", "fc1.bias": "allreduce",
                      "fc2.bias": "allreduce"}
