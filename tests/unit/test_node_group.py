"""A launcher per machine (torchrun's --nnodes): each machine's place and processes, from its flags and torchrun's
PET_* variables; literal tables."""

from __future__ import annotations

import argparse

import pytest

from sluice.launch.node_group import NodeGroup, is_local_host, listen_address, node_group, port_clash, processes


def _here(host: str) -> bool:  # this machine's addresses, in these tables
    return host in ("127.0.0.1", "h0")


def _args(**given: object) -> argparse.Namespace:
    fields: dict[str, object] = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None,
                                 "rdzv_endpoint": None, "rdzv_conf": None, "hosts": None, "hostfile": None}
    return argparse.Namespace(**{**fields, **given})


@pytest.mark.parametrize(("given", "environ", "want"), [
    ({}, {}, None),  # one machine: the usual job
    ({"nnodes": "1"}, {}, None),
    ({"nnodes": "2", "node_rank": 1, "master_addr": "m"}, {}, NodeGroup(2, 1, 4, ("m", 29501), 29500, (2, 2))),
    ({"nnodes": "3", "node_rank": 0, "master_port": 4000}, {}, NodeGroup(3, 0, 4, ("127.0.0.1", 4001), 4000, (3, 3))),
    ({"nnodes": "2:2", "node_rank": 1}, {}, NodeGroup(2, 1, 4, ("127.0.0.1", 29501), 29500, (2, 2))),
    ({"nnodes": "2", "node_rank": 1, "rdzv_endpoint": "m:7000"}, {}, NodeGroup(2, 1, 4, ("m", 7000), 29500, (2, 2))),
    ({"nnodes": "2", "node_rank": 1, "rdzv_endpoint": "m"}, {}, NodeGroup(2, 1, 4, ("m", 29400), 29500, (2, 2))),
    # torchrun reads every flag from PET_<FLAG> when it is not given (a Kubernetes PyTorchJob sets them)
    ({}, {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m"},
     NodeGroup(2, 1, 4, ("m", 29501), 29500, (2, 2))),
    ({"node_rank": 0}, {"PET_NNODES": "2", "PET_NODE_RANK": "1"},
     NodeGroup(2, 0, 4, ("127.0.0.1", 29501), 29500, (2, 2))),
    ({"nnodes": "2", "node_rank": 0}, {"PET_MASTER_PORT": "3000"},
     NodeGroup(2, 0, 4, ("127.0.0.1", 3001), 3000, (2, 2))),
    ({"nnodes": "2"}, {"PET_RDZV_ENDPOINT": "r:5"}, NodeGroup(2, None, 4, ("r", 5), 29500, (2, 2))),
    # no rank given, as torchrun's c10d rendezvous allows: 0 where the rendezvous address is, else machine 0's
    # answer (None: to be asked)
    ({"nnodes": "2", "rdzv_endpoint": "h0:9"}, {}, NodeGroup(2, 0, 4, ("h0", 9), 29500, (2, 2))),
    ({"nnodes": "2", "rdzv_endpoint": "h1:9"}, {}, NodeGroup(2, None, 4, ("h1", 9), 29500, (2, 2))),
    ({"nnodes": "3", "master_addr": "h0"}, {}, NodeGroup(3, 0, 4, ("h0", 29501), 29500, (3, 3))),
    ({"nnodes": "5", "master_addr": "h1"}, {}, NodeGroup(5, None, 4, ("h1", 29501), 29500, (5, 5))),
    # c10d's endpoint on 29500, as SLURM scripts often have it: torchrun ignores --master-port there, so the store
    # moves past the scheduler's ports and machine 0's service; one given (flag or PET_) is kept, and then clashes
    ({"nnodes": "2", "rdzv_endpoint": "h0:29500"}, {}, NodeGroup(2, 0, 4, ("h0", 29500), 29504, (2, 2))),
    ({"nnodes": "2", "rdzv_endpoint": "h0:29498"}, {}, NodeGroup(2, 0, 4, ("h0", 29498), 29502, (2, 2))),
    ({"nnodes": "2", "rdzv_endpoint": "h0:29500", "master_port": 29500}, {},
     NodeGroup(2, 0, 4, ("h0", 29500), 29500, (2, 2))),
    # torchrun's elastic range: each start's machines and ranks come from its round (machine 0's, where the
    # rendezvous address is), so a rank given is ignored, as c10d ignores it; --rdzv-conf's two timeouts are taken
    ({"nnodes": "2:4", "rdzv_endpoint": "h0:9"}, {}, NodeGroup(0, 0, 4, ("h0", 9), 29500, (2, 4))),
    ({"nnodes": "2:4", "rdzv_endpoint": "h1:9", "node_rank": 1}, {}, NodeGroup(0, None, 4, ("h1", 9), 29500, (2, 4))),
    ({}, {"PET_NNODES": "1:3", "PET_RDZV_ENDPOINT": "h1:9", "PET_NODE_RANK": "2",
          "PET_RDZV_CONF": "join_timeout=60, last_call_timeout=2.5,keep_alive_interval=5"},
     NodeGroup(0, None, 4, ("h1", 9), 29500, (1, 3), 60.0, 2.5)),
    ({"nnodes": "1:4", "rdzv_conf": "last_call_timeout=1"}, {"PET_RDZV_CONF": "last_call_timeout=9"},
     NodeGroup(0, 0, 4, ("127.0.0.1", 29501), 29500, (1, 4), 600.0, 1.0)),  # on its own: machine 0
])
def test_each_machine_s_place_from_torchruns_flags(given: dict[str, object], environ: dict[str, str],
                                                   want: NodeGroup | None) -> None:
    assert node_group(_args(**given), environ, 4, is_here=_here) == want


def test_the_workers_of_each_machine_from_torchruns_variable_too() -> None:
    group = node_group(_args(nnodes="2", node_rank=0), {"PET_NPROC_PER_NODE": "3"}, None, is_here=_here)
    assert group == NodeGroup(2, 0, 3, ("127.0.0.1", 29501), 29500, (2, 2))


@pytest.mark.parametrize(("given", "workers", "message"), [
    ({"nnodes": "4:2"}, 4, "give the number of machines .1 or more., or a range MIN:MAX"),
    ({"nnodes": "0:2"}, 4, "give the number of machines"),
    ({"nnodes": "2:4", "rdzv_conf": "last_call_timeout=-1"}, 4, "give last_call_timeout in seconds, above 0"),
    ({"nnodes": "2:4", "rdzv_conf": "join_timeout=soon"}, 4, "give join_timeout in seconds"),
    ({"nnodes": "0"}, 4, "give the number of machines"),
    ({"nnodes": "two"}, 4, "give the number of machines"),
    ({"nnodes": "2", "node_rank": 2}, 4, "give this machine's rank, 0 to 1"),
    ({"nnodes": "2", "node_rank": -1}, 4, "give this machine's rank, 0 to 1"),
    ({"nnodes": "2", "node_rank": 1, "hosts": "a:2,b:2"}, 4, "give one or the other"),
    ({"nnodes": "2", "node_rank": 1}, None, "--nnodes without --nproc-per-node"),
    ({"nnodes": "2", "node_rank": 1, "rdzv_endpoint": "m:x"}, 4, "expected HOST or HOST:PORT"),
    ({"nnodes": "1", "node_rank": 1}, 4, "give this machine's rank, 0 to 0"),
    ({"nnodes": "2"}, 4, "the rendezvous address 127.0.0.1 is this machine's loopback"),
])
def test_what_cannot_run_says_what_to_change(given: dict[str, object], workers: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        node_group(_args(**given), {}, workers, is_here=_here)


@pytest.mark.parametrize(("nnodes", "node_rank", "servers", "want"), [
    (2, 0, 0, [("scheduler", 0, 0), ("worker", 0, 0), ("worker", 1, 1)]),
    (2, 1, 0, [("worker", 2, 0), ("worker", 3, 1)]),
    (2, 0, 3, [("scheduler", 0, 0), ("server", 0, 0), ("server", 2, 0), ("worker", 0, 0), ("worker", 1, 1)]),
    (2, 1, 3, [("server", 1, 0), ("worker", 2, 0), ("worker", 3, 1)]),
    (3, 2, 2, [("worker", 4, 0), ("worker", 5, 1)]),  # no server falls on the third machine
])
def test_each_machine_runs_its_workers_its_servers_and_machine_0_the_scheduler(
        nnodes: int, node_rank: int, servers: int, want: list[tuple[str, int, int]]) -> None:
    assert processes(NodeGroup(nnodes, node_rank, 2, ("m", 1), 2, (nnodes, nnodes)), servers) == want


def test_processes_listen_on_loopback_when_machine_0_is_this_one() -> None:
    assert listen_address("127.0.0.1") == listen_address("localhost") == listen_address("127.0.1.1") == "127.0.0.1"
    assert is_local_host("127.0.0.1") and not is_local_host("192.0.2.1")  # TEST-NET-1: never this machine's


@pytest.mark.parametrize(("rendezvous", "master", "clash"), [(29501, 29500, False), (29400, 29500, False),
                                                             (29497, 29500, True), (29496, 29500, False),
                                                             (29498, 29500, True), (29500, 29500, True)])
def test_the_workers_master_port_must_lie_outside_the_schedulers_ports_and_the_rank_service_s(
        rendezvous: int, master: int, clash: bool) -> None:
    assert (port_clash(NodeGroup(2, 0, 2, ("m", rendezvous), master, (2, 2)), 3) is not None) == clash
