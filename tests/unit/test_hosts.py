"""Multi-host job descriptions (pure): -H lists, hostfiles, SLURM node lists and the role layout, as literal tables."""

from __future__ import annotations

import pytest

from sluice.launch.hosts import Host, HostsError, expand_nodelist, parse_host_list, parse_hostfile
from sluice.launch.layout import Process, lay_out


@pytest.mark.parametrize(("text", "expected"), [
    ("host1:4,host2:4", [Host("host1", 4), Host("host2", 4)]),
    ("node-1", [Host("node-1", 1)]),
    ("10.0.0.3:2, 10.0.0.4", [Host("10.0.0.3", 2), Host("10.0.0.4", 1)]),
    ("[fd00::1]:8,a.b.example", [Host("fd00::1", 8), Host("a.b.example", 1)]),
])
def test_host_lists(text: str, expected: list[Host]) -> None:
    assert parse_host_list(text) == expected


@pytest.mark.parametrize(("text", "error"), [
    ("h1:0", "slots must be a whole number from 1"),
    ("h1:x", "slots must be a whole number"),
    ("h1:4,h1:2", "listed twice"),
    ("bad_host:2", "not a host name"),
    ("h1,,h2", "an empty item"),
])
def test_bad_host_lists_say_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(HostsError, match=error):
        parse_host_list(text)


def test_hostfile_in_horovods_and_deepspeeds_shape_with_racks() -> None:
    text = "# two racks\nworker-1 slots=4 rack=r1\nworker-2 slots=4 rack=r1  # same rack\n\nworker-3 rack=r2\n"
    assert parse_hostfile(text) == [Host("worker-1", 4, "r1"), Host("worker-2", 4, "r1"), Host("worker-3", 1, "r2")]


@pytest.mark.parametrize(("text", "error"), [
    ("node1 slot=4", r"hf, line 1: 'slot=4' is not slots=N or rack=LABEL; a line is HOST \[slots=N\]"),
    ("node1\nnode2 slots=-1", r"hf, line 2: slots must be"),
    ("node1 rack=a/b", r"hf, line 1: rack label 'a/b'"),
    ("node1\nnode1 slots=2", "listed twice"),
    ("# nothing\n", "no hosts"),
    ("no_such..host", "not a host name"),
])
def test_bad_hostfiles_name_the_line(text: str, error: str) -> None:
    with pytest.raises(HostsError, match=error):
        parse_hostfile(text, "hf")


@pytest.mark.parametrize(("text", "expected"), [
    ("node1", ["node1"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("a[9-11]-ib", ["a9-ib", "a10-ib", "a11-ib"]),
])
def test_slurm_node_lists_expand_as_scontrol_does(text: str, expected: list[str]) -> None:
    assert expand_nodelist(text) == expected


@pytest.mark.parametrize(("text", "error"), [("n[3-1]", "not N or N-M"), ("n[1-2", "not closed"), ("", "no nodes"),
                                             ("n[1-99999]", "more than")])
def test_bad_node_lists(text: str, error: str) -> None:
    with pytest.raises(HostsError, match=error):
        expand_nodelist(text)


HOSTS = [Host("a", 2), Host("b", 2), Host("c", 1)]


def test_workers_fill_slots_in_order_and_servers_spread_over_hosts() -> None:
    layout = lay_out(HOSTS, None, servers=4)
    assert layout.scheduler == "a"
    assert [p for p in layout.processes if p.role == "worker"] == [
        Process("worker", 0, "a", 0), Process("worker", 1, "a", 1), Process("worker", 2, "b", 0),
        Process("worker", 3, "b", 1), Process("worker", 4, "c", 0)]
    assert [(p.rank, p.host, p.local_rank) for p in layout.processes if p.role == "server"] == [
        (0, "a", 0), (1, "b", 0), (2, "c", 0), (3, "a", 1)]


def test_fewer_workers_than_slots_and_chosen_server_hosts() -> None:
    layout = lay_out(HOSTS, 3, servers=2, aggregators=1, server_hosts=["c"], scheduler_host="b")
    assert layout.scheduler == "b"
    assert [(p.role, p.rank, p.host, p.local_rank) for p in layout.processes] == [
        ("worker", 0, "a", 0), ("worker", 1, "a", 1), ("worker", 2, "b", 0),
        ("server", 0, "c", 0), ("server", 1, "c", 1), ("aggregator", 0, "c", 0)]
    assert [p.rank for p in layout.on("a")] == [0, 1]


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"workers": 6, "servers": 0}, r"-w 6 asks for more workers than the hosts have slots \(5\)"),
    ({"workers": 0, "servers": 0}, "at least one worker"),
    ({"workers": None, "servers": 1, "server_hosts": ["z"]}, "server host 'z' is not one of the job's hosts"),
    ({"workers": None, "servers": 1, "scheduler_host": "z"}, "scheduler host 'z'"),
])
def test_impossible_layouts_say_what_to_change(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(HostsError, match=error):
        lay_out(HOSTS, **kwargs)  # type: ignore[arg-type]
