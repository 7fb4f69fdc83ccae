"""The options of `sluice launch`, and where its worker command starts (`--`, or the first word that is no option)."""

from __future__ import annotations

import argparse
import difflib
import textwrap
from collections.abc import Sequence

from sluice.launch.config import help_epilog
from sluice.launch.foreign_flags import add_horovodrun_flags, add_torchrun_flags
from sluice.launch.run_options import LOG_LEVELS, log_level

FORMATTER = argparse.RawDescriptionHelpFormatter
#: the scheduler's seconds to announce its address unless --ready-timeout or HOROVOD_START_TIMEOUT says otherwise
DEFAULT_READY_TIMEOUT = 60.0
#: horovodrun's variable for its --start-timeout (Horovod's own default: 30 s)
HOROVOD_START_TIMEOUT = "HOROVOD_START_TIMEOUT"
USAGE = ("sluice launch -w N [-s M] [-a K] [-H HOST:N,... | --hostfile PATH] [--config PATH] "
         "[--set SECTION.FIELD=VALUE ...] [--] COMMAND [ARGS ...]")


class LaunchArgsError(ValueError):
    """A command line `sluice launch` cannot split; the text names the flag and what was meant."""


def wrap(text: str) -> str:
    return textwrap.fill(text, 100)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH",
                        help="TOML file with [transport], [scheduler], [ps] and [worker] tables")
    parser.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", default=[], dest="sets",
                        help="override one configuration key (repeatable); beats the file and SLUICE_* "
                             "environment variables; the keys are listed below")


def add_launch_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`sluice launch`, among the subcommands of `sluice`."""
    launch = commands.add_parser(
        "launch", formatter_class=FORMATTER, epilog=help_epilog(), usage=USAGE, allow_abbrev=False,
        help="run a job: a scheduler, M servers and N workers running COMMAND, here or over several hosts",
        description=wrap("Runs a job on this machine or over several hosts (-H, --hostfile, a SLURM allocation): one "
                         "scheduler, M servers and N workers, each worker running COMMAND with SLUICE_* variables "
                         "telling it its rank and the scheduler's address. Output of every process is printed with "
                         "a [role rank] prefix. If any process fails, all are stopped and the launcher exits "
                         "non-zero naming it. COMMAND starts after `--`, or at the first word that is not an option "
                         "(as with horovodrun and torchrun); an option the launcher does not know is an error."))
    launch.add_argument("-w", "--workers", type=int, metavar="N",
                        help="number of worker processes, each running COMMAND (required on one machine; with "
                             "hosts, the default is one per slot)")
    launch.add_argument("-s", "--servers", type=int, metavar="M",
                        help="number of parameter-server processes; 0: pure allreduce among the workers "
                             "(collective.mode is then ignored). Default: 0, unless the configuration needs "
                             "servers (-a K > 0, worker.optimizer_on = \"server\", collective.mode = \"ps\", "
                             "collective.ps_patterns, ps.recover, ps.sync = false, aggregation.mode other than "
                             "\"off\"): then one per host (per --server-hosts host), 1 on this machine alone")
    launch.add_argument("-a", "--aggregators", type=int, default=0, metavar="K",
                        help="number of aggregator processes (aggregator-0..K-1), which sum the pushes of the "
                             "workers below them in the aggregation trees ([aggregation] settings) and forward "
                             "one stream to the servers (default: %(default)s)")
    _add_hosts_options(launch)
    _add_elastic_options(launch)
    add_config_options(launch)
    _add_output_options(launch)
    launch.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                        help="after every worker exited 0, wait this long for the scheduler and servers to "
                             "exit by themselves before stopping them; once the job ended, workers still "
                             "running are waited for (their exit codes count), and after this long the "
                             "launcher says which (default: %(default)s)")
    launch.add_argument("--timeline", metavar="PATH",
                        help="write a Chrome trace of the job to PATH (open it in https://ui.perfetto.dev): per "
                             "tensor and step, when it was ready, queued, pushed, summed on a server, pulled and "
                             "applied, with its priority and channel (same as --set timeline.path=PATH)")
    launch.add_argument("--ready-timeout", type=float, metavar="SECONDS",
                        help=f"how long the scheduler may take to announce its address (default: the variable "
                             f"{HOROVOD_START_TIMEOUT} if set, as horovodrun's --start-timeout, else "
                             f"{DEFAULT_READY_TIMEOUT:g})")
    launch.add_argument("--master-port", type=int, metavar="PORT",
                        help="MASTER_PORT for the workers (torch.distributed's rendezvous, on worker 0's host), "
                             "checked free there before the job starts (default: the variable MASTER_PORT if set, "
                             "else a port found free on worker 0's host)")
    launch.add_argument("--preload", metavar="MODULE[,MODULE...]", action="append", default=[],
                        help="import these modules (e.g. torch) once in a process that forks each worker of this "
                             "machine: a worker then starts without importing them again (torch: 2-3 CPU-s a "
                             "worker, a fork 0.03), also when one is replaced or an elastic job re-forms. Only for "
                             "a COMMAND that runs this Python on a script, -m MODULE or -c CODE (with -u at most); "
                             "others start as before. "
                             "The modules must not start CUDA when imported, nor threads a fork would lose (torch, "
                             "tensorflow and keras are tested so); `ps` shows each worker's own command line")
    add_horovodrun_flags(launch)
    add_torchrun_flags(launch)
    launch.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="[--] COMMAND [ARGS ...]",
                        help="the worker program, e.g. -- python train.py --epochs 3")
    return launch


def _add_hosts_options(launch: argparse.ArgumentParser) -> None:
    hosts = launch.add_argument_group(
        "hosts", wrap("Several machines: the roles start over OpenSSH (every host has the project and its Python at "
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
    hosts.add_argument("--ssh-identity", metavar="PATH",
                       help="the private key ssh logs in with")
    hosts.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an option for ssh (-o KEY=VALUE; repeatable), e.g. UserKnownHostsFile=PATH")


def _add_elastic_options(launch: argparse.ArgumentParser) -> None:
    elastic = launch.add_argument_group(
        "elastic", wrap("With --elastic the job survives workers that die, and grows when hosts are added: it "
                        "runs in generations, and each new one starts from the state the workers last committed "
                        "(hvd.elastic.run and hvd.elastic.TorchState in the script; docs/cluster.md). The optimizer "
                        "must run on the workers. A --host-discovery-script turns --elastic on, as in horovodrun."))
    elastic.add_argument("--elastic", action="store_true",
                         help="re-form the job with the remaining workers when one dies, instead of ending it")
    elastic.add_argument("--min-workers", type=int, metavar="N",
                         help="end the job when fewer workers are left (default: 1); makes the job elastic, as "
                              "horovodrun's --min-np does")
    elastic.add_argument("--max-workers", type=int, metavar="N",
                         help="with --elastic: never run more workers than this (default: -w, or with a host "
                              "discovery script the slots it reports)")
    elastic.add_argument("--host-discovery-script", metavar="PATH",
                         help="a program printing the hosts available now, `host:slots` a line "
                              "(`localhost:N` for this machine); run every --discovery-interval seconds, and when "
                              "it reports more slots the workers re-form the job at their next commit")
    elastic.add_argument("--max-restarts", type=int, metavar="N",
                         help="as torchrun: when a process fails, stop every process and start the job again, up to "
                              "N times (the workers see TORCHELASTIC_RESTART_COUNT; default: the variable "
                              "PET_MAX_RESTARTS, else 0); with --elastic: end the job after N re-formings not caused "
                              "by new hosts (a script that fails the same way every time) (default there: 10)")
    elastic.add_argument("--in-place", action="store_true",
                         help="with --elastic: replace a lost worker by a new process in its slot, and let the "
                              "other workers re-form the job in their own processes (Horovod's elastic: they keep "
                              "their process, CUDA context and data loader) instead of restarting every process")
    elastic.add_argument("--discovery-interval", type=float, default=5.0, metavar="SECONDS",
                         help="with --host-discovery-script: seconds between its runs (default: %(default)s)")


def _add_output_options(launch: argparse.ArgumentParser) -> None:
    output = launch.add_argument_group(
        "output", wrap("Every process's output reaches this terminal with a [role rank] prefix; these add per-rank "
                       "log files, timestamps and log levels."))
    output.add_argument("--output-filename", metavar="DIR",
                        help="also write each process's output to files, as horovodrun does: DIR/rank.N/stdout "
                             "and DIR/rank.N/stderr for worker N (N zero-padded so that they sort), "
                             "DIR/server.N, DIR/aggregator.N and DIR/scheduler likewise; made if missing, "
                             "files replaced")
    output.add_argument("--prefix-output-with-timestamp", action="store_true",
                        help="put the local time (ISO 8601, milliseconds) before every line of output, on the "
                             "terminal and in the files")
    output.add_argument("--log-level", type=log_level, metavar="LEVEL",
                        help=f"the least level of the launcher's own lines ([launch]) and of the Sluice log lines "
                             f"of every process: {', '.join(LOG_LEVELS)} (horovodrun's TRACE and FATAL are "
                             f"DEBUG and CRITICAL; default: INFO; also the variables SLUICE_LOG_LEVEL and, below it, "
                             f"Horovod's HOROVOD_LOG_LEVEL)")
    output.add_argument("--verbose", action="store_true",
                        help="say more: --log-level DEBUG, and the launcher names each process and its command "
                             "line as it starts it")
    output.add_argument("--log-with-timestamp", action="store_true",
                        help="put the time in the Sluice log lines of every process")


def option_arity(parser: argparse.ArgumentParser) -> dict[str, int]:
    """How many values each option string of `parser` takes (argparse's nargs: None is one value)."""
    arity: dict[str, int] = {}
    for action in parser._actions:
        nargs = action.nargs
        count = 1 if nargs is None else nargs if isinstance(nargs, int) else 1
        for option in action.option_strings:
            arity[option] = count
    return arity


def split_command(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(the launcher's options, the worker command): the command starts at `--` or at the first word that
    is not an option; an option the launcher does not know is a LaunchArgsError naming the nearest one."""
    arity = option_arity(parser)
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return list(argv[:index]), list(argv[index + 1 :])
        if not word.startswith("-") or word == "-":
            return list(argv[:index]), list(argv[index:])
        name, equals, _ = word.partition("=")
        if word in arity:
            index += 1 + arity[word]
        elif (equals and arity.get(name) == 1) or _attached_value(word, arity):
            index += 1
        else:
            raise LaunchArgsError(unknown_option(name, arity))
    return list(argv), []


def _attached_value(word: str, arity: dict[str, int]) -> bool:
    """Is `word` a one-letter option with its value attached, as -w4 or -Hnode1:4?"""
    return not word.startswith("--") and arity.get(word[:2]) == 1


def unknown_option(name: str, arity: dict[str, int]) -> str:
    """The error for an option `sluice launch` does not know, naming the nearest one that it does."""
    # without dashes, which would make any two look alike; --name wins over horovodrun's -name
    bare = {option.lstrip("-"): option for option in sorted(arity, key=lambda o: o.startswith("--"))}
    close = difflib.get_close_matches(name.lstrip("-"), bare, n=1, cutoff=0.6)
    hint = f"; did you mean {bare[close[0]]}?" if close else "; `sluice launch --help` lists the options"
    return (f"unknown option {name}{hint} (the worker command starts after `--` or at the first word that is "
            "not an option, e.g. sluice launch -np 2 python train.py)")
