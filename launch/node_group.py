"""`sluice launch --nnodes N --node-rank K`: one launcher per machine, as torchrun is run, each starting its share.

torchrun is started once on every machine of a job (by hand, by `srun`, by a Kubernetes PyTorchJob or a cloud's
training service), with the same --nnodes, --nproc-per-node and master address everywhere and the machine's own
--node-rank, or none (c10d). Given those, `sluice launch` does the same: machine K runs workers K*P .. K*P+P-1
(LOCAL_RANK 0..P-1), server S of `-s` on machine S mod N, and machine 0 also the scheduler, listening on the
rendezvous port (--rdzv-endpoint's, else the port above --master-port; each flag also from torchrun's PET_*
variable); the workers' MASTER_PORT is --master-port (29500 by default) as under torchrun, for torch.distributed's
own store. Machine 0 is the machine with the rendezvous address; a machine without --node-rank asks it for one
(launch/machine_zero.py, on the port after the scheduler's). Each process starts as `sluice node` would start it
(launch/node.py), so every machine needs the job secret: --secret-file, or `--set transport.curve=false` on a
network you trust. The launcher prefixes its processes' output and stops them all when one fails, and tells
machine 0, whose count of the job's starts every other launcher follows: the other machines stop theirs within
a second, whichever machine failed first (a scheduler that could not start on machine 0 as well as a worker);
with --max-restarts, every machine's processes start again instead. With an elastic
range (--nnodes MIN:MAX, as Kubeflow's elastic PyTorchJob sets PET_NNODES), each start's machines are those that
joined its round (launch/node_ranks.py), and the job's size (WORLD_SIZE, the scheduler's workers) is theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from sluice.launch.config import SluiceConfig
from sluice.launch.hosts import HostsError
from sluice.launch.machine_zero import MachineZero, RankError, rank_keys
from sluice.launch.node import NodeError, is_loopback, job_secret
from sluice.launch.node_ranks import new_ask
from sluice.launch.nproc import nproc_per_node
from sluice.launch.reach import host_address, is_this_machine, outward_address
from sluice.launch.run_options import RunOptions
from sluice.transport.auth import SecretFileError

#: torchrun's defaults: the master port, and the c10d rendezvous port of an --rdzv-endpoint without one
MASTER_PORT, RDZV_PORT = 29500, 29400


@dataclass(frozen=True)
class NodeGroup:
    """This machine's place in a job started by one launcher per machine."""

    #: the machines of the current start (an elastic range's: 0 until its round closed)
    nnodes: int
    #: None: to be asked of machine 0 (launch/machine_zero.py)
    node_rank: int | None
    nproc: int
    #: where the scheduler listens (machine 0's address and the rendezvous port)
    rendezvous: tuple[str, int]
    #: the workers' MASTER_PORT (MASTER_ADDR is the rendezvous host)
    master_port: int
    #: --nnodes MIN:MAX (N:N for a fixed count)
    nodes: tuple[int, int]
    #: --rdzv-conf's join_timeout and last_call_timeout (torchrun's defaults), for an elastic range
    join_s: float = 600.0
    last_call_s: float = 30.0

    @property
    def elastic(self) -> bool:
        return self.nodes[0] != self.nodes[1]


def add_node_flags(group: argparse._ArgumentGroup) -> None:
    """torchrun's flags of a job started once per machine."""
    group.add_argument("--nnodes", metavar="N|MIN:MAX", help="machines in the job, each running `sluice launch` with "
                       "its own --node-rank, or none; MIN:MAX: torchrun's elastic range, every machine's processes "
                       "starting again whenever a machine joins or fails (default: the variable PET_NNODES, as "
                       "torchrun, else 1)")
    group.add_argument("--node-rank", "--node_rank", type=int, metavar="K",
                       help="this machine's rank, 0..N-1; machine 0 runs the scheduler (default: PET_NODE_RANK, "
                            "else 0 on the machine of --master-addr (--rdzv-endpoint), and on the others the next "
                            "rank machine 0 hands out, in the order they ask, as torchrun's c10d rendezvous)")
    group.add_argument("--master-addr", "--master_addr", metavar="HOST",
                       help="machine 0's address, which every machine reaches (default: PET_MASTER_ADDR, else "
                            "127.0.0.1)")
    group.add_argument("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST[:PORT]",
                       help=f"machine 0's address and the scheduler's port (default port {RDZV_PORT}), instead of "
                            "--master-addr and --master-port")
    group.add_argument("--rdzv-conf", "--rdzv_conf", metavar="KEY=VALUE,...",
                       help="with --nnodes MIN:MAX: join_timeout (default 600 s: how long a start waits for its "
                            "machines) and last_call_timeout (default 30 s: how long it waits for more after MIN), as "
                            "torchrun's c10d rendezvous (default: PET_RDZV_CONF); other keys are ignored")
    group.add_argument("--secret-file", metavar="PATH",
                       help="with --nnodes > 1: the job secret, the same file content on every machine (at least 16 "
                            "bytes, mode 0600); without it, --set transport.curve=false on a network you trust")


def node_group(args: argparse.Namespace, environ: Mapping[str, str], workers: int | None, channels: int = 3,
               is_here: Callable[[str], bool] = lambda host: is_local_host(host)) -> NodeGroup | None:
    """This machine's place, when the job runs one launcher per machine (--nnodes above 1); None otherwise.
    `workers`: -w or --nproc-per-node; `channels`: transport.channels (the scheduler's ports); `is_here`: whether an
    address is this machine's. ValueError saying what to change."""
    raw = args.nnodes if args.nnodes is not None else environ.get("PET_NNODES", "1")
    low, _, high = raw.partition(":")
    high = high or low
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise ValueError(f"--nnodes {raw!r}: give the number of machines (1 or more), or a range MIN:MAX")
    nodes = (int(low), int(high))
    nnodes = nodes[0] if nodes[0] == nodes[1] else 0
    if nodes == (1, 1):
        rank_raw = args.node_rank if args.node_rank is not None else environ.get("PET_NODE_RANK", "0")
        if str(rank_raw) != "0":
            raise ValueError(f"--node-rank {rank_raw}: give this machine's rank, 0 to 0")
        return None
    if args.hosts or args.hostfile:
        raise ValueError("--nnodes with -H or --hostfile: give one or the other. With --nnodes, `sluice launch` "
                         "runs on every machine and starts that machine's processes; with -H, once, for all")
    if workers is None and environ.get("PET_NPROC_PER_NODE"):
        workers = nproc_per_node(environ["PET_NPROC_PER_NODE"], environ)
    if not workers:
        raise ValueError("--nnodes without --nproc-per-node: give the workers of each machine")
    master = str(args.master_port or environ.get("PET_MASTER_PORT") or MASTER_PORT)
    if not master.isdigit() or not 0 < int(master) < 65535:
        raise ValueError(f"--master-port {master}: give a port from 1 to 65534")
    endpoint = args.rdzv_endpoint or environ.get("PET_RDZV_ENDPOINT")
    if endpoint:
        host, colon, port = endpoint.rpartition(":")
        if not colon:
            host, port = endpoint, str(RDZV_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST or HOST:PORT")
        rendezvous = (host, int(port))
        if not (args.master_port or environ.get("PET_MASTER_PORT")) and port_clash(
                NodeGroup(nnodes, 0, workers, rendezvous, int(master), nodes), channels):
            # torchrun's c10d ignores --master-port (its agent picks the store's port), so an endpoint on 29500, as
            # many SLURM scripts have it, is fine there: the store goes on the first port after machine 0's service
            master = str(int(port) + channels + 1)
    else:  # the scheduler beside torch's store, on the port above it
        rendezvous = (args.master_addr or environ.get("PET_MASTER_ADDR") or "127.0.0.1", int(master) + 1)
    join_s, last_call_s = rdzv_conf(args.rdzv_conf if args.rdzv_conf is not None else environ.get("PET_RDZV_CONF", ""))
    if nnodes:
        rank = _node_rank(args, environ, nnodes, rendezvous[0], is_here)
    else:  # torchrun's c10d numbers the machines of an elastic range itself, ignoring --node-rank
        rank = 0 if is_loopback(rendezvous[0]) or is_here(rendezvous[0]) else None
    return NodeGroup(nnodes, rank, workers, rendezvous, int(master), nodes, join_s, last_call_s)


def rdzv_conf(raw: str) -> tuple[float, float]:
    """(join_timeout, last_call_timeout) of torchrun's --rdzv-conf "key=value,...", its defaults for those not given;
    ValueError for one that is not a positive number of seconds."""
    taken = {"join_timeout": 600.0, "last_call_timeout": 30.0}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, _, value = item.partition("=")
        if key.strip() in taken:
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if not 0 < seconds < 10**7:
                raise ValueError(f"--rdzv-conf {item}: give {key.strip()} in seconds, above 0")
            taken[key.strip()] = seconds
    return taken["join_timeout"], taken["last_call_timeout"]


def _node_rank(args: argparse.Namespace, environ: Mapping[str, str], nnodes: int, rendezvous_host: str,
               is_here: Callable[[str], bool]) -> int | None:
    """--node-rank, else PET_NODE_RANK, else as torchrun's c10d rendezvous has it: 0 on the machine that has the
    rendezvous address, None (ask machine 0) on the others."""
    raw = args.node_rank if args.node_rank is not None else environ.get("PET_NODE_RANK")
    if raw is None:
        if is_loopback(rendezvous_host):  # every launcher of the job is on this machine: which is which?
            raise ValueError(f"--node-rank is needed: the rendezvous address {rendezvous_host} is this machine's "
                             "loopback, so every launcher runs here; give each its rank, 0 to "
                             f"{nnodes - 1}")
        return 0 if is_here(rendezvous_host) else None
    rank = int(raw) if str(raw).lstrip("-").isdigit() else -1
    if not 0 <= rank < nnodes:
        raise ValueError(f"--node-rank {raw}: give this machine's rank, 0 to {nnodes - 1}")
    return rank


def is_local_host(host: str) -> bool:
    """Is `host` an address of this machine (launch/reach.py's test)? False when it cannot be resolved."""
    try:
        return is_this_machine(host_address(host))
    except HostsError:
        return False


def rank_port(group: NodeGroup, channels: int) -> int:
    """Where machine 0 serves the other launchers (launch/machine_zero.py): the port after the scheduler's channels."""
    return group.rendezvous[1] + channels


def port_clash(group: NodeGroup, channels: int) -> str | None:
    """Why the workers' MASTER_PORT cannot be used beside the scheduler, whose channels take the ports from the
    rendezvous port on, and machine 0's rank service the next, or None."""
    first, last = group.rendezvous[1], rank_port(group, channels)
    if first <= group.master_port <= last:
        return (f"the scheduler and machine 0's rank service listen on ports {first}-{last} (--rdzv-endpoint, one a "
                f"channel, and one more), and --master-port {group.master_port} is among them: give ports "
                f"{channels + 1} or more apart")
    return None


def processes(group: NodeGroup, servers: int) -> list[tuple[str, int, int]]:
    """(role, rank, local rank) of this machine's processes: the scheduler on machine 0, server s on machine
    s mod N, and P workers a machine in machine order (local rank: the worker's place on its machine)."""
    assert group.node_rank is not None, "a machine's rank is known before its processes are"
    mine: list[tuple[str, int, int]] = [("scheduler", 0, 0)] if group.node_rank == 0 else []
    mine += [("server", s, 0) for s in range(servers) if s % group.nnodes == group.node_rank]
    first = group.node_rank * group.nproc
    mine += [("worker", first + local, local) for local in range(group.nproc)]
    return mine


def listen_address(rendezvous_host: str) -> str:
    """The address of this machine that reaches `rendezvous_host` (launch/reach.py's outward address), which every
    process here listens on: 127.0.0.1 for a loopback one; HostsError when it cannot be resolved or reached."""
    address = "127.0.0.1" if is_loopback(rendezvous_host) else host_address(rendezvous_host)
    return "127.0.0.1" if ipaddress.ip_address(address).is_loopback else outward_address(address)


def run_node_group(group: NodeGroup, args: argparse.Namespace, command: list[str], servers: int | None,
                   options: RunOptions, sets: list[str], config: SluiceConfig, restarts: int = 0) -> int:
    """Start this machine's processes and supervise them; the launcher's exit code. The processes listen on the
    configured transport.host unless it is the loopback default and machine 0 is another machine. A machine
    without a rank asks machine 0 for one first; every machine follows machine 0's starts."""
    from sluice.launch.node_group_run import NodeGroupRun

    sets = list(sets)
    if config.transport.host.startswith("127."):
        try:
            address = listen_address(group.rendezvous[0])
        except HostsError as exc:
            print(f"sluice: error: cannot reach {group.rendezvous[0]} (--master-addr or --rdzv-endpoint): {exc}",
                  file=sys.stderr)
            return 2
        if address != "127.0.0.1":  # the processes here must be reachable from the other machines
            sets.append(f"transport.host={address}")
    zero = None
    try:
        if group.node_rank != 0:  # a line to machine 0: for a rank, and for the job's starts (a failure anywhere)
            zero = _machine_zero(group, args, config, restarts)
        if group.node_rank is None and not group.elastic:  # an elastic range's machines join each start instead
            assert zero is not None

            def say(text: str) -> None:
                if not options.quiet:
                    print(f"[launch] {text}", flush=True)

            say(f"asking machine 0 at {zero.host}:{zero.port} for this machine's rank")
            rank = zero.request("rank", config.scheduler.rendezvous_timeout, say,
                                until=lambda answer: answer.rank is not None).rank
            group = replace(group, node_rank=rank)
    except (RankError, NodeError, SecretFileError, HostsError) as exc:
        if zero is not None:
            zero.close()
        print(f"sluice launch: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except BaseException:  # Ctrl-C while asking: the socket closed before its context goes
        if zero is not None:
            zero.close()
        raise
    return asyncio.run(NodeGroupRun(group, args, command, servers, options, sets, config, restarts, zero).run())


def _machine_zero(group: NodeGroup, args: argparse.Namespace, config: SluiceConfig, restarts: int) -> MachineZero:
    """This machine's line to machine 0's launcher (launch/machine_zero.py)."""
    host, _ = group.rendezvous
    secret = job_secret(args.secret_file, config.transport.curve, [])
    return MachineZero(host_address(host), rank_port(group, config.transport.channels),
                       rank_keys(secret) if secret else None, new_ask("rank", group.nodes, group.nproc, restarts))
