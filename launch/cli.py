"""The `sluice` command: launch a local job, run one role of a job, or show the resolved config."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from types import FrameType

import sluice.launch.lean_roles  # first: it must run before anything imports numpy
from sluice import __version__
from sluice.errors import SluiceError
from sluice.launch import kubernetes, node
from sluice.launch.config import ConfigError, help_epilog, load_config
from sluice.launch.launch_args import FORMATTER as _FORMATTER
from sluice.launch.launch_args import LaunchArgsError, add_config_options, add_launch_parser, split_command
from sluice.launch.launch_args import wrap as _wrap
from sluice.launch.launch_job import error as _error
from sluice.launch.launch_job import run_launch
from sluice.launch.run_options import configure_role_logging
from sluice.scheduler.bootstrap import ENV_ROLE, from_environ


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Sluice: parameter-server training over ZeroMQ.", formatter_class=_FORMATTER,
        epilog="run `sluice COMMAND --help` for the options of each command")
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    add_launch_parser(commands)

    config = commands.add_parser(
        "config", formatter_class=_FORMATTER, epilog=help_epilog(),
        help="print the resolved configuration (defaults, file, environment, --set)",
        description=_wrap("Prints the configuration a job would run with, one `section.field = value` line per key "
                    "(valid TOML), noting where each non-default value came from."))
    add_config_options(config)
    config.add_argument("--json", action="store_true", help="print the sections as JSON instead")

    jobs = commands.add_parser(
        "jobs", formatter_class=_FORMATTER,
        help="list the Sluice jobs running on this host, or in the cluster (the job registry)",
        description=_wrap("Lists the jobs whose schedulers run on this host, from the job registry: each "
                    "scheduler publishes its job there about once a second (jobs.registry_dir, or the variable "
                    "SLUICE_JOBS_REGISTRY_DIR; default /tmp/sluice-jobs-<uid>). With [jobs] priorities on, "
                    "`level` is the job's priority level (0: the top) and `sent MiB` what its busiest worker has "
                    "pushed (docs/aggregation.md). With --registry, the jobs of every host that report to the "
                    "cluster's registry (jobs.registry)."))
    jobs.add_argument("--json", action="store_true", help="print the entries as a JSON list instead")
    jobs.add_argument("--registry", metavar="HOST:PORT", default=os.environ.get("SLUICE_JOBS_REGISTRY", ""),
                      help="list the cluster's jobs from the registry the jobs report to (jobs.registry; default: "
                           "the variable SLUICE_JOBS_REGISTRY) instead of this host's")
    jobs.add_argument("--registry-secret-file", metavar="PATH",
                      default=os.environ.get("SLUICE_JOBS_REGISTRY_SECRET_FILE", ""),
                      help="the registry secret the jobs use (jobs.registry_secret_file; default: the variable "
                           "SLUICE_JOBS_REGISTRY_SECRET_FILE); without it, only an unauthenticated registry answers")

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


def _list_jobs(as_json: bool, registry: str = "", secret_file: str = "") -> int:
    import dataclasses
    import json

    from sluice.scheduler.jobs_registry import describe, read_all, registry_dir

    if registry:
        return _list_cluster_jobs(as_json, registry, secret_file)
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


def _list_cluster_jobs(as_json: bool, registry: str, secret_file: str) -> int:
    import zmq

    from sluice.scheduler.jobs_registry import describe
    from sluice.scheduler.registry_client import query
    from sluice.scheduler.registry_service import load_keys

    try:
        jobs, refused = query(registry, load_keys(secret_file, curve=False))
    except (OSError, ValueError, zmq.ZMQError) as exc:  # TimeoutError, a secret file refused, a bad HOST:PORT
        return _error(str(exc))
    if as_json:
        print(json.dumps([dataclasses.asdict(j) for j in jobs]))
    else:
        print(describe(jobs) if jobs else f"no Sluice jobs in the registry at {registry}")
    if refused:
        print(f"sluice: the registry has refused {refused} malformed or unauthenticated messages", file=sys.stderr)
    return 0


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
    configure_role_logging(os.environ)
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


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed; for `sluice launch`, its worker command split off first: it starts at `--` or at the
    first word that is not an option, and an unknown option before it is an error (launch/launch_args.py)."""
    if argv[:1] != ["launch"]:
        return parser.parse_args(argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    launch = commands.choices["launch"]
    try:
        options, command = split_command(argv[1:], launch)
    except LaunchArgsError as exc:
        launch.error(str(exc))  # the usage, the error, and SystemExit(2)
    args = parser.parse_args(["launch", *options])
    args.worker_command = command
    return args


def main(argv: list[str] | None = None) -> int:
    code: int | None = None
    try:
        code = _main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left early (`sluice config | head -1`): end quietly
        # Python's documented recipe: stdout onto /dev/null, so that the flush at exit raises nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0 if code is None else code  # cut short by its reader, not failed


def _main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # --help and usage errors: hand the code back instead of exiting
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "launch":
        return run_launch(args)
    if args.command == "config":
        return _show_config(args)
    if args.command in sluice.launch.lean_roles.ROLES:
        return _run_role(args.command)
    if args.command == "jobs":
        return _list_jobs(args.json, args.registry, args.registry_secret_file)
    if args.command == "node":
        return node.run(args)
    if args.command == "kubernetes":
        return kubernetes.run_manifest(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
