"""horovodrun's and torchrun's flags in `sluice launch`: aliases of ours, settings they stand for, ones ignored here.

Each gets its own line in `sluice launch --help`, in a group per launcher, saying what it means here.
A flag without a meaning in Sluice is accepted, so that a horovodrun command line runs as it is,
and the launcher says on stderr that it was ignored and why.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice import __version__
from sluice.launch.node_group import add_node_flags
from sluice.launch.nproc import nproc_per_node

#: horovodrun's flags that `sluice launch` has under the same names
SAME_NAMES = ("-H/--hosts, --hostfile, --ssh-port, --host-discovery-script, --output-filename, --verbose, "
              "--log-level, --log-with-timestamp and --prefix-output-with-timestamp")
IGNORED_DEST = "ignored_flags"
SETS_DEST = "foreign_sets"


@dataclass(frozen=True)
class Alias:
    flags: tuple[str, ...]
    dest: str
    metavar: str | None  # None: a switch
    kind: type[Any]
    ours: str


@dataclass(frozen=True)
class Setting:
    flags: tuple[str, ...]
    metavar: str
    key: str
    scale: int  # the flag's unit in the key's (MB -> bytes)
    about: str


HOROVOD_ALIASES = (
    Alias(("-np", "--num-proc"), "workers", "N", int, "-w N"),
    Alias(("-hostfile",), "hostfile", "PATH", str, "--hostfile"),
    Alias(("-p",), "ssh_port", "PORT", int, "--ssh-port"),
    Alias(("-i", "--ssh-identity-file"), "ssh_identity", "PATH", str, "--ssh-identity"),
    Alias(("--min-np", "--min-num-proc"), "min_workers", "N", int, "--min-workers"),
    Alias(("--max-np", "--max-num-proc"), "max_workers", "N", int, "--max-workers"),
    Alias(("--reset-limit",), "reset_limit", "N", int, "--max-restarts with --elastic"),
    Alias(("--start-timeout",), "ready_timeout", "SECONDS", float, "--ready-timeout"),
    Alias(("--timeline-filename",), "timeline", "PATH", str, "--timeline"),
    Alias(("--config-file",), "config", "PATH", str, "--config: Sluice's TOML, not Horovod's YAML"),
    Alias(("-prefix-timestamp",), "prefix_output_with_timestamp", None, bool, "--prefix-output-with-timestamp"),
    Alias(("--no-log-hide-timestamp",), "log_with_timestamp", None, bool, "--log-with-timestamp"),
    Alias(("--slots-per-host",), "slots_per_host", "N", int,
          "the slots of each -H host given without :N (a discovery script's lines say host:slots)"),
)
HOROVOD_SETTINGS = (
    Setting(("--fusion-threshold-mb",), "MB", "collective.fusion_bytes", 1 << 20, "fusion groups of at most MB"),
    Setting(("--cycle-time-ms",), "MS", "collective.cycle_ms", 1, "the coordinator's cycle"),
    Setting(("--stall-check-shutdown-time-seconds",), "SECONDS", "collective.stall_timeout", 1,
            "a stalled operation fails after SECONDS, naming the ranks that did not submit it"),
    Setting(("--gloo-timeout-seconds",), "SECONDS", "scheduler.op_timeout", 1, "an operation's deadline"),
)
_NO_GLOO = "Sluice has its own transport (ZeroMQ over TCP, shared memory within a host), not Gloo or MPI"
_NO_AUTOTUNE = "Sluice does not autotune: it plans fusion groups from the gradients' sizes and order"
_RENDEZVOUS = ("with --nnodes, machine 0's launcher is the rendezvous (--master-addr or --rdzv-endpoint), and the "
               "machines take their ranks from --node-rank, else from machine 0 in the order they come")
#: (flags, how many values each takes, why it means nothing here)
HOROVOD_IGNORED: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("--gloo", "--mpi", "--jsrun"), 0, _NO_GLOO),
    (("--mpi-threads-disable", "--no-mpi-threads-disable"), 0, _NO_GLOO),
    (("--mpi-args", "--binding-args"), 1, "no mpirun is started"),
    (("--disable-cache",), 0, "Sluice runs no start-up checks to cache"),
    (("--network-interface", "--network-interfaces"), 1,
     "each host's processes listen on the address its name resolves to: give the hosts' addresses on the "
     "network to use in -H or the hostfile (transport.host for this machine)"),
    (("--tcp",), 0, "Sluice already uses TCP between hosts (transport.protocol)"),
    (("--cache-capacity",), 1, "Sluice keeps no response cache to size"),
    (("--hierarchical-allgather", "--no-hierarchical-allgather", "--torus-allreduce", "--no-torus-allreduce"), 0,
     "Sluice picks ring or tree allreduce by size (collective.algorithm); sums per rack are its aggregation "
     "trees' (-a K, docs/aggregation.md)"),
    (("--autotune", "--no-autotune"), 0, _NO_AUTOTUNE),
    (("--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
      "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise"), 1, _NO_AUTOTUNE),
    (("--timeline-mark-cycles", "--no-timeline-mark-cycles"), 0, "Sluice's timeline has no cycle marks"),
    (("--no-stall-check", "--stall-check"), 0,
     "Sluice's stall check is always on: --stall-check-shutdown-time-seconds sets when a stall fails"),
    (("--stall-check-warning-time-seconds",), 1, "Sluice fails a stall with a named error instead of warning"),
    (("--num-nccl-streams",), 1, "Sluice does not use NCCL"),
    (("--thread-affinity",), 1, "Sluice does not pin its threads"),
    (("--elastic-timeout",), 1, "each generation starts as a job does: scheduler.rendezvous_timeout bounds it"),
    (("--blacklist-cooldown-range",), 2, "a failed worker's slot is dropped for the rest of the job"),
    (("--log-without-timestamp", "--log-hide-timestamp"), 0, "Sluice's log lines have no time unless asked"),
)
#: Horovod's variables without a meaning here, each with the flag of the same meaning, whose reason is theirs (the
#: variables that mean something: launch/config.py's HOROVOD_VARS, HOROVOD_LOG_LEVEL, HOROVOD_START_TIMEOUT)
HOROVOD_IGNORED_VARS = {
    "HOROVOD_CACHE_CAPACITY": "--cache-capacity", "HOROVOD_HIERARCHICAL_ALLGATHER": "--hierarchical-allgather",
    "HOROVOD_TORUS_ALLREDUCE": "--torus-allreduce", "HOROVOD_AUTOTUNE": "--autotune",
    "HOROVOD_AUTOTUNE_LOG": "--autotune-log-file", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "--autotune-warmup-samples",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "--autotune-steps-per-sample",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "--autotune-bayes-opt-max-samples",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "--autotune-gaussian-process-noise",
    "HOROVOD_TIMELINE_MARK_CYCLES": "--timeline-mark-cycles", "HOROVOD_STALL_CHECK_DISABLE": "--no-stall-check",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "--stall-check-warning-time-seconds",
    "HOROVOD_MPI_THREADS_DISABLE": "--mpi-threads-disable", "HOROVOD_NUM_NCCL_STREAMS": "--num-nccl-streams",
    "HOROVOD_THREAD_AFFINITY": "--thread-affinity", "HOROVOD_LOG_HIDE_TIME": "--log-hide-timestamp",
    "HOROVOD_ELASTIC_TIMEOUT": "--elastic-timeout", "HOROVOD_CONTROLLER": "--gloo",
    "HOROVOD_CPU_OPERATIONS": "--gloo", "HOROVOD_GPU_OPERATIONS": "--num-nccl-streams",
}
TORCHRUN_ALIASES = (
    Alias(("--master_port",), "master_port", "PORT", int, "--master-port"),
    Alias(("--log-dir", "--log_dir"), "output_filename", "DIR", str,
          "--output-filename: DIR/rank.N/stdout and stderr, on the terminal too"),
    Alias(("--max_restarts",), "max_restarts", "N", int, "--max-restarts"),
)
TORCHRUN_IGNORED: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("--rdzv-backend", "--rdzv_backend", "--rdzv-id", "--rdzv_id"), 1, _RENDEZVOUS),
    (("--standalone",), 0, "a job on one machine is what `sluice launch` without hosts runs"),
    (("--monitor-interval", "--monitor_interval"), 1,
     "the launcher is each local worker's parent and learns of its exit at once"),
    (("--start-method", "--start_method"), 1,
     "each worker is a process of its own, started afresh or forked from --preload's"),
    (("--event-log-handler", "--event_log_handler"), 1, "the launcher's [launch] lines and --timeline record the job"),
    (("--role",), 1, "workers are named worker N in the output"),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters", "--duplicate-stderr-filters",
      "--duplicate_stderr_filters"), 1, "--log-dir keeps each rank's whole output"),
    (("--local-addr", "--local_addr"), 1, "each host's processes listen on the address its name resolves to"),
    (("--logs-specs", "--logs_specs"), 1, "per-rank log files take --log-dir's layout, DIR/rank.N/stdout and stderr"),
    (("--numa-binding", "--numa_binding"), 1,
     "Sluice does not bind workers to NUMA nodes: put numactl in the worker command"),
    (("--signals-to-handle", "--signals_to_handle"), 1, "the launcher stops the job on SIGINT, SIGTERM and SIGHUP"),
    (("--shutdown-timeout", "--shutdown_timeout"), 1,
     "a worker the launcher stops gets SIGTERM, then SIGKILL after a grace period"),
    (("--virtual-local-rank", "--virtual_local_rank"), 0,
     "LOCAL_RANK is each worker's rank on its host, which picks its GPU"),
)
#: torchrun's --tee and --redirects: 0 none, 1 stdout, 2 stderr, 3 both
STREAMS = {0: frozenset[str](), 1: frozenset({"stdout"}), 2: frozenset({"stderr"}), 3: frozenset({"stdout", "stderr"})}


class _Ignored(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        seen = list(getattr(namespace, self.dest, None) or [])
        seen.append(f"{option_string} is ignored: {self.why}")
        setattr(namespace, self.dest, seen)


class _SetKey(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, key: str = "", scale: int = 1,
                 fixed: str | None = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.key, self.scale, self.fixed = key, scale, fixed  # fixed: a switch's value

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        value = self.fixed if self.fixed is not None else int(values * self.scale) if self.scale != 1 else values
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), f"{self.key}={value}"])


def _add_aliases(group: argparse._ArgumentGroup, aliases: Sequence[Alias]) -> None:
    for alias in aliases:
        if alias.metavar is None:
            group.add_argument(*alias.flags, dest=alias.dest, action="store_true", default=argparse.SUPPRESS,
                               help=f"= {alias.ours}")
        else:
            group.add_argument(*alias.flags, dest=alias.dest, type=alias.kind, metavar=alias.metavar,
                               default=argparse.SUPPRESS, help=f"= {alias.ours}")


def _add_ignored(group: argparse._ArgumentGroup, ignored: Sequence[tuple[tuple[str, ...], int, str]]) -> None:
    for flags, values, why in ignored:
        group.add_argument(*flags, action=_Ignored, nargs=values, why=why, dest=IGNORED_DEST, default=None,
                           metavar=("VALUE",) * values if values else None, help=f"ignored: {why}")


class _CheckBuild(argparse.Action):
    """Prints what this installation can run, as horovodrun --check-build does, and exits 0."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from sluice.launch.check_build import report

        print(report())
        parser.exit(0)


def add_horovodrun_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "horovodrun's flags",
        textwrap.fill(f"horovodrun's command lines run unchanged. The same names as horovodrun's: {SAME_NAMES}. "
                      "The others stand for options or settings of Sluice's, or are ignored with a line on "
                      "stderr saying why:", 100))
    group.add_argument("-v", "--version", action="version", version=f"sluice {__version__}",
                       help="print Sluice's version and exit (= sluice --version)")
    group.add_argument("-cb", "--check-build", action=_CheckBuild,
                       help="list the frameworks, extras and transport features this installation has, and exit")
    _add_aliases(group, HOROVOD_ALIASES)
    for setting in HOROVOD_SETTINGS:
        group.add_argument(*setting.flags, action=_SetKey, key=setting.key, scale=setting.scale, type=float,
                           dest=SETS_DEST, default=None, metavar=setting.metavar,
                           help=f"= --set {setting.key}=" + (f"{setting.metavar} x 2^20" if setting.scale > 1
                                                             else setting.metavar) + f": {setting.about}")
    for flag, value in (("--hierarchical-allreduce", "true"), ("--no-hierarchical-allreduce", "false")):
        group.add_argument(flag, action=_SetKey, key="collective.hierarchical", fixed=value, nargs=0, dest=SETS_DEST,
                           default=None, help=f"= --set collective.hierarchical={value}: fused gradients summed "
                                              "inside each host first, each worker's share alone crossing hosts "
                                              "(on by default where every host runs as many workers)")
    _add_ignored(group, HOROVOD_IGNORED)


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("torchrun's flags", "torchrun's habits, where they mean something here:")
    group.add_argument("--nproc-per-node", "--nproc_per_node", metavar="N|cpu|gpu|auto",
                       help="workers per machine: on this machine alone, -w N; with -H, the slots of each host "
                            "given without :N; cpu: this machine's CPUs, gpu: its CUDA devices, auto: those if any, "
                            "else its CPUs (as torchrun; default: the variable PET_NPROC_PER_NODE if set)")
    _add_aliases(group, TORCHRUN_ALIASES)
    for flags, what in ((("--tee", "-t"), "copied into the log files and shown here"),
                        (("--redirects", "-r"), "written to the log files only, not shown here")):
        group.add_argument(*flags, type=_streams, metavar="{0,1,2,3}",
                           help=f"with --log-dir: the streams {what} (0 none, 1 stdout, 2 stderr, 3 both; by "
                                "default, with --log-dir, both are written to the files and shown here)")
    group.add_argument("-m", "--module", action="store_true",
                       help="run COMMAND as a Python module, `python -u -m COMMAND ARGS`, as torchrun does")
    group.add_argument("--no-python", "--no_python", action="store_true",
                       help="run COMMAND as it is. Without it, a COMMAND that is a .py file without execute "
                            "permission runs as `python -u SCRIPT ARGS` with this Python, as torchrun runs every "
                            "script (an executable one runs by its #! line, as before)")
    group.add_argument("--run-path", "--run_path", action="store_true",
                       help="run COMMAND, a script, with this Python whatever its permissions (torchrun's; before "
                            "--no-python)")
    group.add_argument("--local-ranks-filter", "--local_ranks_filter", type=_ranks, metavar="RANKS",
                       help="show only the output of the workers of these local ranks on the terminal, e.g. 0 or "
                            "0,1 (on every host); the log files of --log-dir keep every rank's")
    add_node_flags(group)
    _add_ignored(group, TORCHRUN_IGNORED)


def _ranks(text: str) -> frozenset[int]:
    try:
        ranks = frozenset(int(word) for word in text.split(","))
    except ValueError:
        ranks = frozenset()
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of local ranks, e.g. 0,1,2")
    return ranks


def python_command(command: list[str], module: bool, no_python: bool, python: str, run_path: bool = False
                   ) -> list[str]:
    """The worker command torchrun's way: `-m` runs it as a module and a .py file without execute permission as a
    script, both with `python` (an executable file, or any other program, as it is; with `run_path`, any script
    with `python`); ValueError for -m with --no-python, as torchrun."""
    if run_path and command:
        return [python, "-u", *command]
    if module and no_python:
        raise ValueError("Don't use both the '--no-python' flag and the '--module' flag at the same time.")
    if module:
        return [python, "-u", "-m", *command]
    if not no_python and command and command[0].endswith(".py") and os.path.isfile(command[0]) \
            and not os.access(command[0], os.X_OK):
        return [python, "-u", *command]
    return command


def ignored_variables(environ: Mapping[str, str]) -> list[str]:
    """A note for each of Horovod's variables set in `environ` that means nothing here, saying why."""
    why = {flag: reason for flags, _, reason in HOROVOD_IGNORED for flag in flags}
    return [f"the variable {name} is ignored: {why[flag]}" for name, flag in HOROVOD_IGNORED_VARS.items()
            if name in environ]


def _streams(text: str) -> frozenset[str]:
    if not text.isdigit() or int(text) not in STREAMS:
        raise argparse.ArgumentTypeError(f"{text!r}: give one of 0 (none), 1 (stdout), 2 (stderr), 3 (both); "
                                         "a value per rank (0:1,1:2) is not supported")
    return STREAMS[int(text)]


def translate(args: argparse.Namespace, has_hosts: bool,
              environ: Mapping[str, str] = os.environ) -> tuple[list[str], list[str]]:
    """Apply what the foreign flags in `args` mean (it is changed in place): the --set items they stand for,
    and the notes to print; ValueError saying what to change."""
    notes = list(getattr(args, IGNORED_DEST, None) or [])
    slots = getattr(args, "slots_per_host", None)
    per_node = args.nproc_per_node
    if per_node is None and args.workers is None and not has_hosts:  # torchrun's variable for its flag
        per_node = environ.get("PET_NPROC_PER_NODE")
    if per_node is not None:
        per_node = args.nproc_per_node = nproc_per_node(str(per_node), environ)
    if per_node is not None and not has_hosts:
        if args.workers is not None and args.workers != per_node:
            raise ValueError(f"--nproc-per-node {per_node} and -w {args.workers} disagree: on one machine they "
                             "are the same count; give one of them")
        args.workers = per_node
    elif per_node is not None:
        slots = per_node
    if slots is not None:
        if slots < 1:
            raise ValueError(f"--slots-per-host/--nproc-per-node {slots}: a host needs at least one slot")
        if args.hosts:
            args.hosts = ",".join(item if ":" in item or item.endswith("]") or not item else f"{item}:{slots}"
                                  for item in (part.strip() for part in args.hosts.split(",")))
        else:
            notes.append(f"--slots-per-host/--nproc-per-node {slots} is ignored: it gives the slots of -H hosts "
                         "written without :N; a hostfile says slots=N, a discovery script host:slots, and a "
                         "SLURM allocation its tasks per node")
    command = getattr(args, "worker_command", None)
    if command is not None:
        args.worker_command = python_command(command, args.module, args.no_python, sys.executable, args.run_path)
    if (args.tee or args.redirects) and not args.output_filename:
        raise ValueError("--tee and --redirects choose what goes into the log files: give --log-dir DIR too")
    if args.tee and args.redirects and args.tee & args.redirects:
        raise ValueError("--tee and --redirects name the same stream: a stream is either copied (--tee) or "
                         "moved (--redirects) into the log files")
    return list(getattr(args, SETS_DEST, None) or []), notes
