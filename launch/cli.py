"""The `sluice` command: launch a local job, run one role of a job, or show the resolved config."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import textwrap
from types import FrameType

from sluice import __version__
from sluice.errors import SluiceError
from sluice.launch import kubernetes, node
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import ConfigError, SluiceConfig, help_epilog, load_config
from sluice.launch.elastic import ElasticSettings
from sluice.launch.hosts import Host
from sluice.scheduler.bootstrap import ENV_ROLE, from_environ

_FORMATTER = argparse.RawDescriptionHelpFormatter


def _wrap(text: str) -> str:
    return textwrap.fill(text, 100)


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH",
                        help="TOML file with [transport], [scheduler], [ps] and [worker] tables")
    parser.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", default=[], dest="sets",
                        help="override one configuration key (repeatable); beats the file and SLUICE_* "
                             "environment variables; the keys are listed below")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Sluice: parameter-server training over ZeroMQ.", formatter_class=_FORMATTER,
        epilog="run `sluice COMMAND --help` for the options of each command")
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    launch = commands.add_parser(
        "launch", formatter_class=_FORMATTER, epilog=help_epilog(),
        usage="sluice launch -w N -s M [-a K] [-H HOST:N,... | --hostfile PATH] [--config PATH] "
              "[--set SECTION.FIELD=VALUE ...] -- COMMAND [ARGS ...]",
        help="run a job: a scheduler, M servers and N workers running COMMAND, here or over several hosts",
        description=_wrap("Runs a job on this machine or over several hosts (-H, --hostfile, a SLURM allocation): one "
                    "scheduler, M servers and N workers, each worker running "
                    "COMMAND with SLUICE_* variables telling it its rank and the scheduler's address. Output of "
                    "every process is printed with a [role rank] prefix. If any process fails, all are stopped "
                    "and the launcher exits non-zero naming it."))
    launch.add_argument("-w", "--workers", type=int, metavar="N",
                        help="number of worker processes, each running COMMAND (required on one machine; with "
                             "hosts, the default is one per slot)")
    launch.add_argument("-s", "--servers", type=int, required=True, metavar="M",
                        help="number of parameter-server processes; 0: pure allreduce among the workers "
                             "(collective.mode is then ignored)")
    launch.add_argument("-a", "--aggregators", type=int, default=0, metavar="K",
                        help="number of aggregator processes (aggregator-0..K-1), which sum the pushes of the "
                             "workers below them in the aggregation trees ([aggregation] settings) and forward "
                             "one stream to the servers (default: %(default)s)")
    hosts = launch.add_argument_group(
        "hosts", _wrap("Several machines: the roles start over OpenSSH (every host has the project and its Python at "
                       "the same paths, and `ssh HOST` works without a password), or, inside a SLURM allocation "
                       "(sbatch, salloc) and without -H, with srun on the allocation's nodes. The scheduler runs "
                       "where `sluice launch` runs. See docs/cluster.md."))
    hosts.add_argument("-H", "--hosts", metavar="HOST:N,...",
                       help="the hosts and their worker slots, e.g. -H node1:4,node2:4 (a host without :N has 1)")
    hosts.add_argument("--hostfile", metavar="PATH",
                       help="a file of `HOST [slots=N] [rack=LABEL]` lines (Horovod's and DeepSpeed's shape); rack "
                            "labels become aggregation.racks unless that is set")
    hosts.add_argument("--server-hosts", metavar="HOST,...",
                       help="put the servers (and aggregators) round-robin on these hosts only (default: all hosts, "
                            "so each host's link carries a share of the servers' traffic)")
    hosts.add_argument("--ssh-port", type=int, metavar="PORT", help="the port of the hosts' ssh servers")
    hosts.add_argument("--ssh-identity", metavar="PATH", help="the private key ssh logs in with")
    hosts.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an option for ssh (-o KEY=VALUE; repeatable), e.g. UserKnownHostsFile=PATH")
    elastic = launch.add_argument_group(
        "elastic", _wrap("With --elastic the job survives workers that die, and grows when hosts are added: it "
                         "runs in generations, and each new one starts from the state the workers last committed "
                         "(hvd.elastic.run and hvd.elastic.TorchState in the script; docs/cluster.md). The optimizer "
                         "must run on the workers."))
    elastic.add_argument("--elastic", action="store_true",
                         help="re-form the job with the remaining workers when one dies, instead of ending it")
    elastic.add_argument("--min-workers", type=int, metavar="N",
                         help="with --elastic: end the job when fewer workers are left (default: 1)")
    elastic.add_argument("--max-workers", type=int, metavar="N",
                         help="with --elastic: never run more workers than this (default: -w, or with a host "
                              "discovery script the slots it reports)")
    elastic.add_argument("--host-discovery-script", metavar="PATH",
                         help="with --elastic: a program printing the hosts available now, `host:slots` a line "
                              "(`localhost:N` for this machine); run every --discovery-interval seconds, and when "
                              "it reports more slots the workers re-form the job at their next commit")
    elastic.add_argument("--max-restarts", type=int, default=10, metavar="N",
                         help="with --elastic: end the job after N re-formings not caused by new hosts (a "
                              "script that fails the same way every time) (default: %(default)s)")
    elastic.add_argument("--discovery-interval", type=float, default=5.0, metavar="SECONDS",
                         help="with --host-discovery-script: seconds between its runs (default: %(default)s)")
    _add_config_options(launch)
    launch.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                        help="after every worker exited 0, wait this long for the scheduler and servers to "
                             "exit by themselves before stopping them (default: %(default)s)")
    launch.add_argument("--timeline", metavar="PATH",
                        help="write a Chrome trace of the job to PATH (open it in https://ui.perfetto.dev): per "
                             "tensor and step, when it was ready, queued, pushed, summed on a server, pulled and "
                             "applied, with its priority and channel (same as --set timeline.path=PATH)")
    launch.add_argument("--ready-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long the scheduler may take to announce its address (default: %(default)s)")
    launch.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS ...]",
                        help="the worker program, e.g. -- python train.py --epochs 3")

    config = commands.add_parser(
        "config", formatter_class=_FORMATTER, epilog=help_epilog(),
        help="print the resolved configuration (defaults, file, environment, --set)",
        description=_wrap("Prints the configuration a job would run with, one `section.field = value` line per key "
                    "(valid TOML), noting where each non-default value came from."))
    _add_config_options(config)
    config.add_argument("--json", action="store_true", help="print the sections as JSON instead")

    jobs = commands.add_parser(
        "jobs", formatter_class=_FORMATTER,
        help="list the Sluice jobs running on this host (the job registry)",
        description=_wrap("Lists the jobs whose schedulers run on this host, from the job registry: each "
                    "scheduler publishes its job there about once a second (jobs.registry_dir, or the variable "
                    "SLUICE_JOBS_REGISTRY_DIR; default /tmp/sluice-jobs-<uid>). With [jobs] priorities on, "
                    "`level` is the job's priority level (0: the top) and `sent MiB` what its busiest worker has "
                    "pushed (docs/aggregation.md)."))
    jobs.add_argument("--json", action="store_true", help="print the entries as a JSON list instead")

    for role, what in (("scheduler", "the rendezvous and control plane"), ("server", "one parameter server"),
                       ("aggregator", "one aggregator of the aggregation trees")):
        commands.add_parser(
            role, formatter_class=_FORMATTER, epilog=help_epilog(),
            help=f"run {what} (started by `sluice launch`, or by hand on a cluster)",
            description=_wrap(f"Runs {what} of a job. It reads its place in the job from SLUICE_SCHEDULER, "
                        "SLUICE_RANK, SLUICE_NUM_WORKERS, SLUICE_NUM_SERVERS, SLUICE_NUM_AGGREGATORS and the "
                        "resolved configuration "
                        "from SLUICE_CONFIG_JSON, as `sluice launch` sets them, and the job secret from the "
                        "descriptor SLUICE_SECRET_FD names (or runs unauthenticated with transport.curve = false)."
                        + (" It prints `SLUICE_SCHEDULER_READY <endpoint>` once it listens."
                           if role == "scheduler" else "")))
    node.add_parser(commands)
    kubernetes.add_manifest_parser(commands)
    return parser


def _list_jobs(as_json: bool) -> int:
    import dataclasses
    import json

    from sluice.scheduler.jobs_registry import describe, read_all, registry_dir

    try:
        jobs, bad = read_all()
    except OSError as exc:  # a registry others could write into is not read
        return _error(str(exc))
    if as_json:
        print(json.dumps([dataclasses.asdict(j) for j in jobs]))
    elif jobs:
        print(describe(jobs))
    else:
        print(f"no Sluice jobs running on this host (registry: {registry_dir()})")
    if bad:
        print(f"sluice: skipped {bad} malformed entries in {registry_dir()}", file=sys.stderr)
    return 0


def _error(text: str) -> int:
    print(f"sluice: error: {text}", file=sys.stderr)
    return 2


def _launch(args: argparse.Namespace) -> int:
    command = list(args.worker_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.aggregators < 0 or (args.aggregators and not args.servers):
        return _error(f"-a {args.aggregators}: the aggregator count must be 0 or more, and aggregators need "
                      "parameter servers (-s 1 or more)")
    if (args.workers is not None and args.workers < 1) or args.servers < 0:
        return _error(f"a job needs at least one worker and no negative server count, got -w {args.workers} "
                      f"-s {args.servers}")
    if not command:
        return _error("no worker command: put it after --, e.g. sluice launch -w 2 -s 1 -- python train.py")
    if args.grace < 0 or args.ready_timeout <= 0:
        return _error("--grace must be at least 0 and --ready-timeout positive")
    sets = list(args.sets)
    if args.timeline:
        sets.append(f"timeline.path={os.path.abspath(args.timeline)}")
    try:
        config = load_config(args.config, os.environ, sets)
    except ConfigError as exc:
        return _error(str(exc))
    from sluice.launch.cluster import plan_cluster, read_hosts
    from sluice.launch.generations import run_job
    from sluice.launch.hosts import HostsError
    from sluice.launch.reach import Reach
    from sluice.launch.slurm import slurm_refusal

    if (refusal := slurm_refusal(os.environ)) is not None:
        return _error(refusal)
    try:
        hosts, source = read_hosts(args.hosts, args.hostfile, os.environ)
        reach = Reach("srun" if source.startswith("SLURM") else "ssh", args.ssh_port, args.ssh_identity,
                      tuple(args.ssh_option))

        def replan(hosts: list[Host], workers: int | None = None) -> ClusterPlan:
            """The job laid out over `hosts` (workers None: one per slot; an elastic generation's)."""
            return plan_cluster(hosts, source or "host discovery", workers, args.servers, args.aggregators,
                                args.server_hosts, reach, config)

        plan = None
        if hosts:
            plan = replan(hosts, args.workers)
            config = plan.with_racks(config, hosts)
        elif args.server_hosts:
            raise HostsError("--server-hosts needs hosts: give -H or --hostfile")
    except (HostsError, ValueError) as exc:
        return _error(str(exc))
    workers = args.workers
    if plan is not None:
        workers = sum(1 for p in plan.layout.processes if p.role == "worker")
    elif workers is None:
        return _error("-w N is required: how many workers to start on this machine")
    if config.ps.recover and (args.aggregators or not config.ps.sync):
        return _error("ps.recover works with synchronous servers (ps.sync = true) and no aggregators (-a 0)")
    elastic = None
    if args.elastic:
        try:
            elastic = _elastic_settings(args, workers, config)
        except ValueError as exc:
            return _error(str(exc))
    elif args.min_workers or args.max_workers or args.host_discovery_script:
        return _error("--min-workers, --max-workers and --host-discovery-script need --elastic")
    try:
        code = run_job(config, workers, args.servers, command, grace=args.grace,
                       ready_timeout=args.ready_timeout, aggregators=args.aggregators, plan=plan,
                       elastic=elastic, replan=lambda hosts: None if plan is None and all(
                           h.name == "localhost" for h in hosts) else replan(hosts))
    except KeyboardInterrupt:  # before the supervisor's own handlers were installed
        return 130
    if config.timeline.path:
        _merge_timeline(config.timeline.path)
    return code


def _elastic_settings(args: argparse.Namespace, workers: int, config: SluiceConfig) -> ElasticSettings:
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
    settings = ElasticSettings(args.min_workers or 1, maximum, discovery, args.discovery_interval,
                               args.max_restarts)
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


def _show_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, os.environ, args.sets)
    except ConfigError as exc:
        return _error(str(exc))
    print(json.dumps(config.to_sections(), indent=2) if args.json else config.describe())
    return 0


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _announce(endpoint: str) -> None:
    print(f"SLUICE_SCHEDULER_READY {endpoint}", flush=True)


def _run_role(role: str) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        env = from_environ()
        if os.environ.get(ENV_ROLE, role) != role:
            raise SluiceError(f"{ENV_ROLE} is {os.environ[ENV_ROLE]!r} but this is `sluice {role}`")
        env = dataclasses.replace(env, role=role)
        if role == "scheduler":
            from sluice.scheduler.service import run_scheduler

            return run_scheduler(env, announce=_announce)
        if role == "aggregator":
            from sluice.ps.aggregator import run_aggregator

            return run_aggregator(env)
        from sluice.ps.server import run_server

        return run_server(env)
    except SluiceError as exc:
        print(f"sluice {role}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and usage errors: hand the code back instead of exiting
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "launch":
        return _launch(args)
    if args.command == "config":
        return _show_config(args)
    if args.command in ("scheduler", "server", "aggregator"):
        return _run_role(args.command)
    if args.command == "jobs":
        return _list_jobs(args.json)
    if args.command == "node":
        return node.run(args)
    if args.command == "kubernetes":
        return kubernetes.run_manifest(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
