"""`sluice launch` once parsed: its options checked and resolved (the server count too), then the job run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import ConfigError, SluiceConfig, load_config
from sluice.launch.elastic import ElasticSettings
from sluice.launch.foreign_flags import ignored_variables, translate
from sluice.launch.hosts import Host
from sluice.launch.launch_args import DEFAULT_READY_TIMEOUT, HOROVOD_START_TIMEOUT
from sluice.launch.node_group import NodeGroup, node_group
from sluice.launch.run_options import RunOptions, run_options


def error(text: str) -> int:
    print(f"sluice: error: {text}", file=sys.stderr)
    return 2


def servers_needed(config: SluiceConfig, aggregators: int) -> list[str]:
    """Why the job needs parameter servers (empty: pure allreduce will do)."""
    reasons = [f"-a {aggregators}"] if aggregators > 0 else []
    if config.worker.optimizer_on == "server":
        reasons.append('worker.optimizer_on = "server"')
    if config.collective.mode == "ps":
        reasons.append('collective.mode = "ps"')
    if config.collective.ps_patterns:
        reasons.append("collective.ps_patterns")
    if config.ps.recover:
        reasons.append("ps.recover")
    if not config.ps.sync:
        reasons.append("ps.sync = false")
    if config.aggregation.mode != "off":
        reasons.append(f"aggregation.mode = {config.aggregation.mode!r}")
    return reasons


def default_servers(reasons: Sequence[str], hosts: Sequence[Host], server_hosts: str | None) -> int:
    """-s when not given: 0 for pure allreduce; otherwise one per host that takes servers (1 on one machine)."""
    if not reasons:
        return 0
    if server_hosts:
        return len([name for name in server_hosts.split(",") if name.strip()])
    return max(len(hosts), 1)


def _options(args: argparse.Namespace, hosts_given: bool) -> tuple[RunOptions, list[str]]:
    """The run options and the extra --set items of the foreign flags (notes printed); ValueError."""
    sets, notes = translate(args, hosts_given)
    for note in [*notes, *ignored_variables(os.environ)]:
        print(f"sluice launch: {note}", file=sys.stderr)
    return run_options(args, os.environ), sets


def ready_timeout(flag: float | None, environ: Mapping[str, str]) -> float:
    """--ready-timeout (--start-timeout), else horovodrun's HOROVOD_START_TIMEOUT (its launch.py reads it for the
    flag's default), else DEFAULT_READY_TIMEOUT; ValueError unless a positive number of seconds."""
    if flag is not None:
        seconds, where = flag, "--ready-timeout (--start-timeout)"
    elif HOROVOD_START_TIMEOUT in environ:
        where = f"{HOROVOD_START_TIMEOUT}={environ[HOROVOD_START_TIMEOUT]!r}"
        try:
            seconds = float(environ[HOROVOD_START_TIMEOUT])
        except ValueError:
            seconds = float("nan")
    else:
        return DEFAULT_READY_TIMEOUT
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{where} must be a positive number of seconds")
    return seconds


def run_launch(args: argparse.Namespace) -> int:
    """Run the job `args` describe; the launcher's exit code."""
    try:  # translates the foreign flags, torchrun's -m and bare scripts among them (the command too)
        options, foreign_sets = _options(args, bool(args.hosts or args.hostfile or os.environ.get("SLURM_JOB_ID")))
    except ValueError as exc:
        return error(str(exc))
    command = list(args.worker_command)
    if args.aggregators < 0 or (args.aggregators and args.servers == 0):
        return error(f"-a {args.aggregators}: the aggregator count must be 0 or more, and aggregators need "
                     "parameter servers (-s 1 or more, or leave -s out)")
    if (args.workers is not None and args.workers < 1) or (args.servers or 0) < 0:
        return error(f"a job needs at least one worker and no negative server count, got -w {args.workers} "
                     f"-s {args.servers}")
    if not command:
        return error("no worker command: put it after the options, e.g. sluice launch -w 2 python train.py "
                     "(or after --)")
    try:
        args.ready_timeout = ready_timeout(args.ready_timeout, os.environ)
    except ValueError as exc:
        return error(str(exc))
    if args.grace < 0:
        return error("--grace must be at least 0")
    sets = [*foreign_sets, *args.sets]
    if args.timeline:
        sets.append(f"timeline.path={os.path.abspath(args.timeline)}")
    try:
        config = load_config(args.config, os.environ, sets)
    except ConfigError as exc:
        hint = (" (--config takes Sluice's TOML file; horovodrun's YAML keys translate to --set items, e.g. "
                "fusion_threshold_mb to collective.fusion_bytes)" if str(args.config).endswith((".yaml", ".yml"))
                else "")
        return error(f"{exc}{hint}")
    try:
        group = node_group(args, os.environ, args.nproc_per_node, config.transport.channels)
    except ValueError as exc:
        return error(str(exc))
    if group is not None:
        return _run_node_group(group, args, config, command, options, sets)
    return _run(args, config, command, options)


def _run_node_group(group: NodeGroup, args: argparse.Namespace, config: SluiceConfig, command: list[str],
                    options: RunOptions, sets: list[str]) -> int:
    """This machine's share of a job run with a launcher per machine (torchrun's --nnodes)."""
    from sluice.launch.node_group import run_node_group

    if args.aggregators or is_elastic(args) or args.server_hosts:
        return error("--nnodes (a launcher per machine) runs workers and servers: -a, --elastic, --min-workers "
                     "and --server-hosts need the one launcher of `sluice launch -H HOSTS` instead")
    from sluice.launch.restarts import max_restarts

    try:
        restarts = max_restarts(args.max_restarts, os.environ)
    except ValueError as exc:
        return error(str(exc))
    reasons = servers_needed(config, 0)
    if args.servers == 0 and reasons:
        return error(f"-s 0, but {' and '.join(reasons)} need parameter servers: give -s 1 or more, or leave -s "
                     "out for one per machine")
    servers = args.servers if args.servers is not None else (None if reasons else 0)  # None: one a machine
    try:
        return run_node_group(group, args, command, servers, options, sets, config, restarts)
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace, config: SluiceConfig, command: list[str], options: RunOptions) -> int:
    from sluice.launch.cluster import plan_cluster, read_hosts
    from sluice.launch.generations import run_job
    from sluice.launch.hosts import HostsError
    from sluice.launch.reach import Reach
    from sluice.launch.restarts import max_restarts
    from sluice.launch.slurm import slurm_refusal

    if (refusal := slurm_refusal(os.environ)) is not None:
        return error(refusal)
    reasons = servers_needed(config, args.aggregators)
    if args.servers == 0 and reasons:
        return error(f"-s 0, but {' and '.join(reasons)} need parameter servers: give -s 1 or more, or leave -s "
                     "out for one per host")
    try:
        hosts, source = read_hosts(args.hosts, args.hostfile, os.environ)
        servers = args.servers if args.servers is not None else default_servers(reasons, hosts, args.server_hosts)
        reach = Reach("srun" if source.startswith("SLURM") else "ssh", args.ssh_port, args.ssh_identity,
                      tuple(args.ssh_option))

        def replan(hosts: list[Host], workers: int | None = None) -> ClusterPlan:
            """The job laid out over `hosts` (workers None: one per slot; an elastic generation's)."""
            return plan_cluster(hosts, source or "host discovery", workers, servers, args.aggregators,
                                args.server_hosts, reach, config)

        plan = None
        if hosts:
            plan = replan(hosts, args.workers)
            config = plan.with_racks(config, hosts)
        elif args.server_hosts:
            raise HostsError("--server-hosts needs hosts: give -H or --hostfile")
    except (HostsError, ValueError) as exc:
        return error(str(exc))
    workers = args.workers
    if plan is not None:
        workers = sum(1 for p in plan.layout.processes if p.role == "worker")
    elif workers is None:
        return error("-w N (or -np N) is required: how many workers to start on this machine")
    if config.ps.recover and not config.ps.sync:
        return error("ps.recover works with synchronous servers (ps.sync = true): turn ps.recover off, or ps.sync on")
    elastic, restarts = None, 0
    try:
        if is_elastic(args):
            elastic = elastic_settings(args, workers, config)
        else:
            restarts = max_restarts(args.max_restarts, os.environ)
    except ValueError as exc:
        return error(str(exc))
    from sluice.launch.takeover import with_replicas

    config, chosen = with_replicas(config, plan, elastic is not None, workers)
    if chosen:
        print(f"[launch] {chosen}", flush=True)
    try:
        code = run_job(config, workers, servers, command, grace=args.grace,
                       ready_timeout=args.ready_timeout, aggregators=args.aggregators, plan=plan,
                       elastic=elastic, replan=lambda hosts: None if plan is None and all(
                           h.name == "localhost" for h in hosts) else replan(hosts), options=options,
                       restarts=restarts)
    except KeyboardInterrupt:  # before the supervisor's own handlers were installed
        return 130
    if config.timeline.path:
        _merge_timeline(config.timeline.path)
    return code


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the job is elastic: --elastic, or as horovodrun has it (its `_is_elastic`), a discovery script or
    --min-workers (--min-np). A --max-workers (--max-np) alone leaves it static, as horovodrun does, with a note;
    ValueError for --in-place alone."""
    if args.elastic or args.host_discovery_script or args.min_workers is not None:
        return True
    if getattr(args, "in_place", False):
        raise ValueError("--in-place needs an elastic job: add --elastic (or --min-workers N)")
    if args.max_workers:
        print("sluice launch: --max-workers (--max-np) is ignored: the job is not elastic (as with horovodrun, "
              "--elastic, --min-workers or --host-discovery-script make it so)", file=sys.stderr)
    return False


def elastic_settings(args: argparse.Namespace, workers: int, config: SluiceConfig) -> ElasticSettings:
    """--elastic's settings, checked; ValueError saying what to change."""
    if config.worker.optimizer_on == "server":
        raise ValueError("--elastic keeps the committed state on the workers: the optimizer must run there "
                         "(worker.optimizer_on = \"worker\")")
    if config.ps.recover:
        raise ValueError("--elastic restarts every process of a generation: ps.recover has nothing to add")
    discovery = args.host_discovery_script
    if discovery is not None and not os.access(discovery, os.X_OK):
        raise ValueError(f"--host-discovery-script {discovery} is not an executable file")
    maximum = args.max_workers or (4096 if discovery else workers)
    minimum = 1 if args.min_workers is None else args.min_workers
    given = args.max_restarts if args.max_restarts is not None else getattr(args, "reset_limit", None)
    settings = ElasticSettings(minimum, maximum, discovery, args.discovery_interval, 10 if given is None else given,
                               getattr(args, "in_place", False))
    if not settings.min_workers <= workers <= settings.max_workers:
        raise ValueError(f"-w {workers} must lie between --min-workers {settings.min_workers} and --max-workers "
                         f"{settings.max_workers}")
    return settings


def _merge_timeline(path: str) -> None:
    from sluice.transport.timeline import merge

    try:
        events = merge(path)
    except OSError as exc:
        print(f"sluice launch: the timeline's parts could not be merged into {path}: {exc}", file=sys.stderr)
        return
    print(f"[launch] timeline: {events} events in {path} (open it in https://ui.perfetto.dev)", flush=True)
