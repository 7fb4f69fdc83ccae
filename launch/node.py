"""`sluice node`: start one process of a job whose processes an outside launcher (Kubernetes) starts one by one."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sluice.launch.config import ConfigError, help_epilog, load_config
from sluice.launch.torchrun_env import torchrun_env
from sluice.scheduler.bootstrap import ENV_INDEX_FAILURES, ENV_SECRET_FD, NodeEnv, secret_pipe
from sluice.transport.auth import SecretFileError, read_secret_file

#: Kubernetes sets it in every pod of an Indexed Job: 0, 1, ... completions - 1
ENV_INDEX = "JOB_COMPLETION_INDEX"
USAGE = ("sluice node -w N -s M [-a K] --scheduler HOST:PORT [--standby HOST:PORT ...] (--secret-file PATH | "
         "--set transport.curve=false) [--index I] [--index-failures N] [--master HOST:PORT] [--config PATH] "
         "[--set SECTION.FIELD=VALUE ...] -- COMMAND [ARGS ...]")
_LOOPBACK_NAMES = frozenset({"localhost", "::1", "[::1]", "ip6-localhost"})
# like `sluice launch`: role processes run this very package, wherever it lies
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


class NodeError(ValueError):
    """A command line, index or secret file this node cannot start with; the text says what to do."""


@dataclass(frozen=True)
class Start:
    """What to exec: the program, its environment (the secret goes separately, through a pipe)."""

    role: str
    rank: int
    argv: list[str]
    env: dict[str, str]
    secret: bytes = dataclasses.field(default=b"", repr=False)
    notes: tuple[str, ...] = ()


def role_of(index: int, workers: int, servers: int, aggregators: int = 0, standbys: int = 0) -> tuple[str, int]:
    """(role, rank) of process `index`: 0 the scheduler, then the servers, the aggregators, the workers, and last
    the standby schedulers (scheduler k >= 1)."""
    size = 1 + servers + aggregators + workers
    if not 0 <= index < size + standbys:
        more = f" and {standbys} standby schedulers" if standbys else ""
        raise NodeError(f"index {index} is outside this job: -w {workers} -s {servers} -a {aggregators}{more} make "
                        f"{size + standbys} processes, indexes 0..{size + standbys - 1} (on Kubernetes: completions "
                        f"= {size + standbys})")
    if index >= size:
        return "scheduler", index - size + 1
    if index == 0:
        return "scheduler", 0
    if index <= servers:
        return "server", index - 1
    if index <= servers + aggregators:
        return "aggregator", index - 1 - servers
    return "worker", index - 1 - servers - aggregators


def job_index(given: int | None, environ: Mapping[str, str]) -> int:
    if given is not None:
        return given
    raw = environ.get(ENV_INDEX)
    if raw is None:
        raise NodeError(f"which process of the job is this? pass --index I, or set {ENV_INDEX} (Kubernetes "
                        "sets it in each pod of an Indexed Job)")
    try:
        return int(raw)
    except ValueError:
        raise NodeError(f"{ENV_INDEX}={raw!r} is not a process index; pass --index I instead") from None


def index_failures(given: int | None, environ: Mapping[str, str]) -> int:
    """How many pods of this index failed before this one (--index-failures, else ENV_INDEX_FAILURES, else 0):
    `sluice kubernetes` sets the variable from the pod's annotation batch.kubernetes.io/job-index-failure-count,
    which a Job with backoffLimitPerIndex keeps."""
    if given is not None:
        if given < 0:
            raise NodeError(f"--index-failures {given}: a count of failed pods is 0 or more")
        return given
    raw = environ.get(ENV_INDEX_FAILURES, "").strip() or "0"
    if not raw.isdigit():
        raise NodeError(f"{ENV_INDEX_FAILURES}={raw!r} is not a count; pass --index-failures N instead")
    return int(raw)


def host_port(text: str, option: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NodeError(f"{option} {text!r}: expected HOST:PORT, e.g. {option} sluice-0.sluice:29400")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Is `host`, as written, a loopback address or name (resolving nothing)?"""
    return host.startswith("127.") or host in _LOOPBACK_NAMES


def job_secret(secret_file: str | None, curve: bool, notes: list[str]) -> bytes:
    """The job secret from `secret_file` while CURVE is on (b"" when off, noted if a file was given); NodeError
    or SecretFileError saying what to give."""
    if not curve:
        if secret_file is not None:
            notes.append(f"transport.curve is off: the secret file {secret_file} is not used")
        return b""
    if secret_file is None:
        raise NodeError("no --secret-file: every process of the job needs the job secret while "
                        "transport.curve is on (the default); put one in a file of mode 0600 (on Kubernetes: "
                        "a Secret mounted as a volume), or --set transport.curve=false on a network you trust")
    return read_secret_file(secret_file)


def plan(args: argparse.Namespace, environ: Mapping[str, str]) -> Start:
    """What this node runs, from the command line and environment; raises NodeError or ConfigError."""
    workers, servers, aggregators = args.workers, args.servers, args.aggregators
    if workers < 1 or servers < 0 or aggregators < 0 or (aggregators and not servers):
        raise NodeError(f"-w {workers} -s {servers} -a {aggregators}: a job needs a worker or more, no negative "
                        "counts, and parameter servers (-s 1 or more) for its aggregators")
    standbys = [host_port(text, "--standby") for text in args.standbys]
    role, rank = role_of(job_index(args.index, environ), workers, servers, aggregators, len(standbys))
    command = list(args.worker_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if role == "worker" and not command:
        raise NodeError("no worker command: put it after --, e.g. sluice node ... -- python train.py")
    host, port = host_port(args.scheduler, "--scheduler")
    config = load_config(args.config, environ, args.sets)
    if config.scheduler.port not in (0, port):
        raise NodeError(f"scheduler.port = {config.scheduler.port}, but --scheduler {args.scheduler} names port "
                        f"{port}: drop the setting (--scheduler sets it for every process of the job)")
    # set on every process, not only the scheduler: the scheduler refuses nodes whose settings differ
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, port=port))
    notes: list[str] = []
    failures = index_failures(args.index_failures, environ)
    if role == "scheduler" and rank == 0 and failures:
        if not standbys:
            raise NodeError(f"the scheduler's pod failed {failures} time(s) before this one, and the job has no "
                            "standby scheduler that took over: a new scheduler cannot rejoin a running job. Start "
                            "the job again; with --standby HOST:PORT (sluice kubernetes --standbys N) a job "
                            "outlives its scheduler")
        # the job went on under a standby: this pod is one now, at the scheduler's address (the nodes' ring)
        rank = len(standbys) + 1
        notes.append(f"the scheduler's pod failed {failures} time(s) before this one: the job goes on under a "
                     f"standby scheduler, so this pod stands by at {host}:{port} in turn")
    if role == "scheduler" and rank:  # a standby listens where the nodes will look for it
        listen = standbys[rank - 1][1] if rank <= len(standbys) else port
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, standby_port=listen))
    if is_loopback(config.transport.host) and not is_loopback(host):
        notes.append(f"warning: transport.host is {config.transport.host}, so processes on other hosts (pods) "
                     "cannot reach this one: set SLUICE_TRANSPORT_HOST to this host's address (on Kubernetes: "
                     "status.podIP from the downward API, as `sluice kubernetes` does)")
    secret = job_secret(args.secret_file, config.transport.curve, notes)
    node = NodeEnv("" if role == "scheduler" and not rank else f"tcp://{host}:{port}", role, rank, workers, servers,
                   config.to_sections(), aggregators=aggregators,
                   standby=",".join(f"tcp://{h}:{p}" for h, p in standbys), ring=bool(standbys))
    env = {**environ, "PYTHONUNBUFFERED": "1", **node.to_environ()}
    env.pop(ENV_SECRET_FD, None)  # one inherited from whoever started us names no pipe of ours
    if role != "worker":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH")) if p)
        return Start(role, rank, [sys.executable, "-m", "sluice.launch.cli", role], env, secret, tuple(notes))
    # torchrun's variables, one process per host (pod), so a DDP script's init_process_group() works
    env.update(torchrun_env(rank, workers, 0, 1, rank, workers))
    if args.master is not None:
        master_host, master_port = host_port(args.master, "--master")
        env.update(MASTER_ADDR=master_host, MASTER_PORT=str(master_port))
    return Start(role, rank, command, env, secret, tuple(notes))


def run(args: argparse.Namespace) -> int:
    """Become the node: exec its program, so that it is the pod's main process and gets its signals."""
    try:
        start = plan(args, os.environ)
    except (NodeError, ConfigError, SecretFileError) as exc:
        print(f"sluice node: error: {exc}", file=sys.stderr)
        return 2
    for note in start.notes:
        print(f"sluice node: {note}", file=sys.stderr)
    print(f"sluice node: {start.role} {start.rank}: {shlex.join(start.argv)}", file=sys.stderr, flush=True)
    env = dict(start.env)
    secret_fd = None
    if start.secret:  # as `sluice launch` hands it over: through a pipe, never argv, environ or logs
        secret_fd = secret_pipe(start.secret)
        env[ENV_SECRET_FD] = str(secret_fd)
    sys.stdout.flush()
    try:
        os.execvpe(start.argv[0], start.argv, env)
    except OSError as exc:
        if secret_fd is not None:
            os.close(secret_fd)
        print(f"sluice node: error: cannot run {shlex.join(start.argv)}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: exec does not return


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-w", "--workers", type=int, required=True, metavar="N", help="worker processes in the job")
    parser.add_argument("-s", "--servers", type=int, required=True, metavar="M",
                        help="parameter-server processes in the job (0: pure allreduce)")
    parser.add_argument("-a", "--aggregators", type=int, default=0, metavar="K",
                        help="aggregator processes in the job (default: %(default)s)")
    parser.add_argument("--scheduler", required=True, metavar="HOST:PORT",
                        help="where the scheduler (index 0) listens; index 0 itself listens on PORT of "
                             "transport.host (SLUICE_TRANSPORT_HOST), e.g. sluice-0.sluice:29400")
    parser.add_argument("--standby", metavar="HOST:PORT", action="append", default=[], dest="standbys",
                        help="a standby scheduler, which the nodes rejoin should the scheduler fall silent "
                             "(repeatable, in the order they are rejoined); standby k runs at index 1 + M + K + N + "
                             "k - 1. The schedulers form a ring: the scheduler's pod started again (--index-failures "
                             ">= 1) stands by in turn at --scheduler's address")
    parser.add_argument("--secret-file", metavar="PATH",
                        help="file holding the job secret (at least 16 bytes, the same for every process; "
                             "readable by no one but its owner and group, e.g. mode 0600). Without it, "
                             "--set transport.curve=false runs the job unauthenticated and unencrypted: only on "
                             "a network you trust")
    parser.add_argument("--index", type=int, metavar="I",
                        help=f"this process's index: 0 the scheduler, 1..M the servers, then the aggregators, "
                             f"then the workers (default: the variable {ENV_INDEX}, set by a Kubernetes Indexed Job)")
    parser.add_argument("--index-failures", type=int, metavar="N",
                        help=f"how many pods of this index failed before this one (default: the variable "
                             f"{ENV_INDEX_FAILURES}, which `sluice kubernetes` sets from the pod's annotation "
                             "batch.kubernetes.io/job-index-failure-count; else 0)")
    parser.add_argument("--master", metavar="HOST:PORT",
                        help="MASTER_ADDR and MASTER_PORT for the workers (torch.distributed's rendezvous)")
    parser.add_argument("--config", metavar="PATH", help="TOML file with the job's settings")
    parser.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", default=[], dest="sets",
                        help="override one configuration key (repeatable); the keys are listed below")
    parser.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS ...]",
                        help="the worker program, e.g. -- python train.py --epochs 3")


_DESCRIPTION = textwrap.fill(
    "Runs one process of a job whose processes are started one by one by another launcher, such as the pods of "
    "a Kubernetes Indexed Job (`sluice kubernetes` writes one): index 0 runs the scheduler on the port "
    "--scheduler names, 1..M the servers, then the aggregators, then the workers, then the standby schedulers "
    "(--standby), each worker running COMMAND "
    "with the SLUICE_* variables and torchrun's RANK, WORLD_SIZE, LOCAL_RANK = 0. It reads the job secret from "
    "--secret-file and hands it over through a pipe, then execs the process, which so receives the signals "
    "sent to this one (Kubernetes' SIGTERM).",
    100)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`sluice node`, among the subcommands of `sluice`."""
    parser = commands.add_parser(
        "node", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=help_epilog(), usage=USAGE,
        help="run one process of a job started by another launcher (a pod of a Kubernetes Indexed Job)",
        description=_DESCRIPTION)
    _add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice node", usage=USAGE, description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=help_epilog())
    _add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and usage errors: hand the code back instead of exiting
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
