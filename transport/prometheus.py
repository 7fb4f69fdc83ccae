"""Prometheus metrics of one process (opt-in, `[metrics] port`): a collector reading existing counters when scraped.

Nothing is added to the data path: the transport keeps counting as it always did (transport/metrics.py,
its refusals in transport/rejects.py) and each role hands over callables for the rest (rounds, routing
epochs, steps); a scrape reads them all, on the HTTP server's thread. Names follow Prometheus'
conventions (base units, `_total` for counters) and every sample carries the labels `role` and `rank`.
The queueing-delay histogram is built from the transport's log bins (8 per octave) at every second
octave, 7 us to 134 s; its `_sum` is estimated from the bins' middles (within 9%), since recording a
sum would cost the data path. Priorities 0-15 are labelled one by one, higher ones by power-of-two
ranges ("16-31", ...), so a model with thousands of tensors still makes a bounded number of series.
`prometheus-client` is optional (the extra `prometheus`): it is imported only when a port is set.
"""

from __future__ import annotations

import importlib.util
import logging
import operator
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.transport.metrics import _BINS, StepTimes, TransportMetrics, bin_middle_s, bin_upper_s
from sluice.transport.rejects import Rejections

log = logging.getLogger("sluice.metrics")

INSTALL_HINT = "pip install 'sluice-ps[prometheus]'"
#: `metrics.port = -1`: each process asks the OS for a free port and logs the address it serves on
ANY_PORT = -1
#: queueing-delay bucket edges: every second octave of the log bins (7 us, 31 us, ... 134 s)
_DELAY_BUCKET_BINS = tuple(range(8 * 3 - 1, 8 * 28, 16))
#: step-time bucket edges: every octave from about 1 ms to 1000 s
_STEP_BUCKET_BINS = tuple(range(8 * 10 - 1, 8 * 30, 8))
_EXACT_PRIORITIES = 16
#: the bins each delay bucket adds (from the previous edge, exclusive, to its own), and each bin's middle:
#: a scrape reduces a priority's 256 bins with a few sums done in C
_DELAY_SLICES = tuple(zip((-1, *_DELAY_BUCKET_BINS), (*_DELAY_BUCKET_BINS, _BINS - 1), strict=True))
_MIDDLES = tuple(bin_middle_s(bin_) for bin_ in range(_BINS))


@dataclass(frozen=True)
class MetricsConfig:
    #: serve Prometheus metrics over HTTP from every process of the job: 0 = off; N = the scheduler on N and
    #: each other process on N + its index in the job (0 the scheduler, then the servers, the aggregators, the
    #: workers: `sluice node --index`'s order); -1 = a port the OS picks, logged by each process
    port: int = 0
    #: the address to serve on; "" = every interface (0.0.0.0) when port is a number, so Prometheus can
    #: scrape from outside the host, and 127.0.0.1 when port = -1
    addr: str = ""
    #: add each process's index to metrics.port (several processes on one host); false: every process
    #: serves on metrics.port itself (one process per pod or host, e.g. Kubernetes and its scrape annotations)
    port_per_process: bool = True

    def __post_init__(self) -> None:
        if not ANY_PORT <= self.port <= 65535:
            raise ValueError(f"metrics.port must be 0 (off), -1 (any free port) or a port 1..65535, got {self.port}")
        if self.port and importlib.util.find_spec("prometheus_client") is None:
            raise ValueError(f"metrics.port is set but prometheus-client is not installed: {INSTALL_HINT}")

    def bind(self, index: int) -> tuple[str, int]:
        """(address, port) for process `index` of the job (port 0: the OS chooses)."""
        if self.port == ANY_PORT:
            return self.addr or "127.0.0.1", 0
        return self.addr or "0.0.0.0", self.port + (index if self.port_per_process else 0)


def process_index(role: str, rank: int, servers: int, aggregators: int) -> int:
    """The index of a process in the job, as `sluice node --index` numbers them (launch/node.py `role_of`)."""
    if role == "scheduler":
        return 0
    if role == "server":
        return 1 + rank
    if role == "aggregator":
        return 1 + servers + rank
    return 1 + servers + aggregators + rank


def priority_label(priority: int) -> str:
    """0..15 as themselves; above, the power-of-two range it falls in ("16-31", "32-63", ...)."""
    if priority < _EXACT_PRIORITIES:
        return str(priority)
    low = 1 << (priority.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def histogram_buckets(bins: Sequence[int], edges: Sequence[int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) buckets from dense log bins, at the given bin edges, ending with +Inf."""
    buckets, seen, edge_at = [], 0, 0
    for bin_, count in enumerate(bins):
        while edge_at < len(edges) and bin_ > edges[edge_at]:
            buckets.append((f"{bin_upper_s(edges[edge_at]):.6g}", float(seen)))
            edge_at += 1
        seen += count
    buckets += [(f"{bin_upper_s(edge):.6g}", float(seen)) for edge in edges[edge_at:]]
    buckets.append(("+Inf", float(seen)))
    return buckets


@dataclass
class Readings:
    """What one process exposes: its transport's counters, its refusals, and its role's own numbers."""

    role: str
    rank: int
    metrics: TransportMetrics | None = None
    rejections: Sequence[Rejections] = ()
    #: refused connections (failed CURVE or ticket handshakes): read at scrape time
    refused_connections: Callable[[], int] | None = None
    #: rounds completed (a server: chunk-rounds summed; a worker: its parameter-server rounds)
    rounds: Callable[[], int] | None = None
    #: plan changes by kind ("routes": aggregation-tree switches, "declarations": tensor plans)
    plan_changes: Callable[[], Mapping[str, int]] | None = None
    steps: StepTimes | None = None
    #: more counters by name (without the sluice_ prefix and _total suffix): help text and reader
    counters: dict[str, tuple[str, Callable[[], float]]] = field(default_factory=dict)

    @classmethod
    def of_transport(cls, role: str, rank: int, transport: Any, *rejections: Rejections) -> Readings:
        """A process's readings from its transport (a ZmqTransport: its metrics and refusals), plus the
        refusals the process counts itself (`rejections`)."""
        return cls(role, rank, transport.metrics, (transport.rejects, *rejections),
                   lambda: int(transport.stats()["refused_connections"]))


def retried(read: Callable[[], int]) -> Callable[[], int]:
    """`read` made safe against a dict that the I/O thread grows while a scrape iterates it."""
    def again() -> int:
        for _ in range(10):
            try:
                return read()
            except RuntimeError:  # "dictionary changed size during iteration": read it again
                continue
        return read()
    return again


class SluiceCollector:
    """A prometheus_client collector over `Readings`; each scrape reads the counters as they are."""

    def __init__(self, readings: Readings) -> None:
        self.readings = readings
        self.labels = {"role": readings.role, "rank": str(readings.rank)}

    def describe(self) -> list[Any]:
        return []  # no fixed set of families: the registry must not call collect() at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        readings, names, values = self.readings, ["role", "rank"], [self.labels["role"], self.labels["rank"]]

        def counter(name: str, help_text: str, extra: Sequence[str] = ()) -> Any:
            return CounterMetricFamily(f"sluice_{name}", help_text, labels=[*names, *extra])

        if readings.metrics is not None:
            totals = readings.metrics.totals()
            for key, name, help_text in (
                ("sent_bytes", "bytes_sent", "payload bytes sent, per channel (0 most urgent)"),
                ("received_bytes", "bytes_received", "payload bytes received, per channel"),
                ("sent_messages", "messages_sent", "messages handed to a socket, per channel"),
                ("acks_sent", "acks_sent", "credit acknowledgements sent, per channel"),
            ):
                family = counter(name, help_text, ["channel"])
                for channel, value in enumerate(totals[key]):
                    family.add_metric([*values, str(channel)], float(value))
                yield family
            yield self._delays(HistogramMetricFamily, totals["queue_delay"], names, values)
        rejected = counter("rejected_messages", "messages refused, by reason: invalid (failed a check, from a "
                           "member or a stranger) or banned_peer (from a stranger cut off for sending garbage)",
                           ["reason"])
        banned = sum(r.banned_drops for r in readings.rejections)
        rejected.add_metric([*values, "invalid"], float(sum(r.total for r in readings.rejections) - banned))
        rejected.add_metric([*values, "banned_peer"], float(banned))
        yield rejected
        if readings.refused_connections is not None:
            refused = counter("refused_connections", "connections refused at the handshake (CURVE, or a ticket)")
            refused.add_metric(values, float(readings.refused_connections()))
            yield refused
        if readings.rounds is not None:
            rounds = counter("rounds", "synchronous rounds completed (a server: summed over its chunks)")
            rounds.add_metric(values, float(readings.rounds()))
            yield rounds
        if readings.plan_changes is not None:
            changes = counter("plan_changes", "plan changes: routes (aggregation trees switched to), "
                              "declarations (tensor tables planned)", ["kind"])
            for kind, count in sorted(readings.plan_changes().items()):
                changes.add_metric([*values, kind], float(count))
            yield changes
        if readings.steps is not None:
            steps = readings.steps
            family = HistogramMetricFamily("sluice_step_seconds", "time between successive optimizer steps",
                                           labels=names)
            family.add_metric(values, histogram_buckets(list(steps.bins), _STEP_BUCKET_BINS), steps.total_s)
            yield family
        for name, (help_text, read) in readings.counters.items():
            family = counter(name, help_text)
            family.add_metric(values, float(read()))
            yield family

    @staticmethod
    def _delays(family_type: Any, delays: Sequence[tuple[int, list[int]]], names: list[str],
                values: list[str]) -> Any:
        family = family_type("sluice_queue_delay_seconds", "time a message waited in the send queues before its "
                             "socket, per priority (0 most urgent; above 15, power-of-two ranges)",
                             labels=[*names, "priority"])
        banded: dict[str, list[int]] = {}  # label -> its priorities' bins added up (in C: map, not a loop)
        for priority, counts in delays:
            label = priority_label(priority)
            into = banded.get(label)
            banded[label] = counts if into is None else list(map(operator.add, into, counts))
        for label, counts in sorted(banded.items(), key=lambda item: int(item[0].split("-")[0])):
            if not any(counts):
                continue
            cumulative, buckets = 0, []
            for edge, (low, high) in zip((*_DELAY_BUCKET_BINS, None), _DELAY_SLICES, strict=True):
                cumulative += sum(counts[low + 1:high + 1])
                buckets.append(("+Inf" if edge is None else f"{bin_upper_s(edge):.6g}", float(cumulative)))
            family.add_metric([*values, label], buckets, sum(map(operator.mul, counts, _MIDDLES)))
        return family

class MetricsServer:
    """The HTTP endpoint of one process (prometheus_client's server on a daemon thread)."""

    def __init__(self, httpd: Any, url: str) -> None:
        self._httpd, self.url = httpd, url

    def close(self, wait: bool = False) -> None:
        """Stop serving and free the port; the server notices within its 0.5 s poll, so a process that is
        ending does not wait for that unless `wait`."""
        def stop() -> None:
            self._httpd.shutdown()
            self._httpd.server_close()

        stopping = threading.Thread(target=stop, name="sluice-metrics-stop", daemon=True)
        stopping.start()
        if wait:
            stopping.join(5.0)


def serve_metrics(section: Mapping[str, Any], readings: Readings, index: int) -> MetricsServer | None:
    """Serve `readings` at http://ADDR:PORT/metrics when the `metrics` config `section` sets a port (None when
    it does not), process `index` of the job; SluiceError naming the address when the port is taken or
    prometheus-client is missing."""
    config = MetricsConfig(**section)
    if not config.port:
        return None
    from sluice.errors import SluiceError

    try:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.process_collector import ProcessCollector
    except ImportError:
        raise SluiceError(f"metrics.port is set but prometheus-client is not installed: {INSTALL_HINT}") from None
    addr, port = config.bind(index)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SluiceCollector(readings))
    ProcessCollector(namespace="sluice", registry=registry)  # CPU seconds, memory, open files of this process
    try:
        httpd, _thread = start_http_server(port, addr, registry)
    except OSError as exc:
        how = (f"metrics.port {config.port} + index {index}" if config.port_per_process and config.port > 0
               else f"metrics.port {config.port}")
        raise SluiceError(f"{readings.role} {readings.rank} cannot serve metrics on {addr}:{port} ({how}): "
                          f"{exc.strerror or exc}; choose another metrics.port, or -1 for any free port") from None
    url = f"http://{addr}:{httpd.server_port}/metrics"
    log.info("%s %d serves Prometheus metrics at %s", readings.role, readings.rank, url)
    return MetricsServer(httpd, url)
