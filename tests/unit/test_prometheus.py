"""The Prometheus collector over our counters: totals that survive resets, buckets from the log bins, labels,
the exposition Prometheus parses, the endpoint's errors (port taken, package missing), the job's port layout."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from sluice.errors import SluiceError
from sluice.launch.node import role_of
from sluice.transport import prometheus
from sluice.transport.metrics import StepTimes, TransportMetrics
from sluice.transport.prometheus import (
    MetricsConfig,
    Readings,
    histogram_buckets,
    priority_label,
    process_index,
    serve_metrics,
)
from sluice.transport.rejects import Rejections

pytestmark = pytest.mark.timeout(20)
client = pytest.importorskip("prometheus_client", reason="prometheus-client is not installed: "
                             "pip install 'sluice-ps[prometheus]'")


def test_totals_count_from_the_start_whatever_reset_cleared() -> None:
    metrics = TransportMetrics(channels=2)
    metrics.sent(1, priority=3, nbytes=100, delay_s=0.001)
    metrics.received_bytes[0] += 7
    metrics.acks_sent[1] += 1
    metrics.reset()  # the printed summaries' window, e.g. after the calibration probes
    metrics.sent(1, priority=3, nbytes=50, delay_s=0.002)
    metrics.sent(0, priority=40, nbytes=1, delay_s=0.0)
    totals = metrics.totals()
    assert totals["sent_bytes"] == [1, 150] and totals["sent_messages"] == [1, 2]
    assert totals["received_bytes"] == [7, 0] and totals["acks_sent"] == [0, 1]
    assert sorted((p, sum(c)) for p, c in totals["queue_delay"]) == [(3, 1), (3, 1), (40, 1)]  # per window
    assert metrics.snapshot()["sent_bytes"] == [1, 50]  # the window itself is unchanged


def test_buckets_are_cumulative_at_the_edges_and_priorities_banded() -> None:
    bins = [0] * 256
    bins[10], bins[100], bins[255] = 2, 3, 1
    buckets = histogram_buckets(bins, (7, 99, 200))
    assert [count for _, count in buckets] == [0, 2, 5, 6]
    assert buckets[0][0] == "1e-06" and buckets[-1][0] == "+Inf"
    assert [priority_label(p) for p in (0, 15, 16, 31, 32, 1000)] == ["0", "15", "16-31", "16-31", "32-63",
                                                                    "512-1023"]


def _exposition(readings: Readings) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(prometheus.SluiceCollector(readings))
    text = client.generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_collector_reads_every_counter_with_role_and_rank_labels() -> None:
    metrics, steps, rejects = TransportMetrics(channels=2), StepTimes(), Rejections(logger=_quiet())
    for priority, delay in ((0, 0.0001), (0, 0.003), (20, 0.5)):
        metrics.sent(0 if priority == 0 else 1, priority, nbytes=1000, delay_s=delay)
    rejects.refuse("worker-1", "malformed", now=0.0)
    for now in (0.0, 0.1, 0.35):
        steps.tick(now)
    readings = Readings("worker", 3, metrics, (rejects,), lambda: 2, rounds=lambda: 17,
                        plan_changes=lambda: {"routes": 1}, steps=steps)
    readings.counters["collectives"] = ("decided", lambda: 4)
    samples = _exposition(readings)
    mine = (("rank", "3"), ("role", "worker"))

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted((*mine, *labels.items()))))]

    assert value("sluice_bytes_sent_total", channel="0") == 2000
    assert value("sluice_bytes_sent_total", channel="1") == 1000
    assert value("sluice_messages_sent_total", channel="1") == 1
    assert value("sluice_queue_delay_seconds_count", priority="0") == 2
    assert value("sluice_queue_delay_seconds_count", priority="16-31") == 1
    assert value("sluice_queue_delay_seconds_bucket", priority="0", le="0.000127") == 1
    assert 0.4 < value("sluice_queue_delay_seconds_sum", priority="16-31") < 0.6  # estimated from the bin
    assert value("sluice_rejected_messages_total", reason="invalid") == 1
    assert value("sluice_rejected_messages_total", reason="banned_peer") == 0
    assert value("sluice_refused_connections_total") == 2
    assert value("sluice_rounds_total") == 17
    assert value("sluice_plan_changes_total", kind="routes") == 1
    assert value("sluice_collectives_total") == 4
    assert value("sluice_step_seconds_count") == 2
    assert value("sluice_step_seconds_sum") == pytest.approx(0.35)
    assert value("sluice_step_seconds_bucket", le="+Inf") == 2


def test_the_endpoint_serves_and_a_taken_port_is_named() -> None:
    served = serve_metrics({"port": -1}, Readings("server", 0, TransportMetrics(1)), 1)
    assert served is not None
    try:
        with urllib.request.urlopen(served.url, timeout=5) as response:
            assert b'sluice_bytes_sent_total{channel="0",rank="0",role="server"} 0.0' in response.read()
        port = int(served.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(SluiceError, match=rf"worker 0 cannot serve metrics on 127.0.0.1:{port} "
                                              rf"\(metrics.port {port - 3} \+ index 3\).*choose another metrics.port"):
            serve_metrics({"port": port - 3, "addr": "127.0.0.1"}, Readings("worker", 0), 3)
    finally:
        served.close()
    assert serve_metrics({}, Readings("worker", 0), 3) is None  # off by default


def test_port_layout_follows_the_job_index_and_the_bind_address_its_rule() -> None:
    for index in range(1 + 2 + 1 + 3):
        role, rank = role_of(index, workers=3, servers=2, aggregators=1)
        assert process_index(role, rank, servers=2, aggregators=1) == index
    assert MetricsConfig(port=9400).bind(4) == ("0.0.0.0", 9404)
    assert MetricsConfig(port=9400, port_per_process=False).bind(4) == ("0.0.0.0", 9400)
    assert MetricsConfig(port=-1).bind(4) == ("127.0.0.1", 0)
    assert MetricsConfig(port=9400, addr="10.0.0.5").bind(0) == ("10.0.0.5", 9400)
    with pytest.raises(ValueError, match=r"metrics\.port must be"):
        MetricsConfig(port=70000)


def test_a_port_without_the_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = prometheus.importlib.util.find_spec
    monkeypatch.setattr(prometheus.importlib.util, "find_spec",
                        lambda name, *a: None if name == "prometheus_client" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'sluice-ps\[prometheus\]'"):
        MetricsConfig(port=9400)
    MetricsConfig(port=0)  # off: nothing to install


def _quiet() -> Any:
    import logging

    logger = logging.getLogger("test.prometheus")
    logger.disabled = True
    return logger

