"""How `sluice launch` runs a job beyond its shape: log level, timestamps, per-rank log files, MASTER_PORT."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

#: the least level of Sluice's log lines in every process of the job (`--log-level`)
ENV_LOG_LEVEL = "SLUICE_LOG_LEVEL"
#: "1": Sluice's log lines carry the time (`--log-with-timestamp`)
ENV_LOG_TIME = "SLUICE_LOG_TIME"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: horovodrun's names for levels Python's logging calls otherwise
_HOROVOD_LEVELS = {"TRACE": "DEBUG", "FATAL": "CRITICAL", "WARN": "WARNING"}
#: Horovod's variable for the same (horovodrun's --log-level sets it; job scripts export it themselves)
HOROVOD_LOG_LEVEL = "HOROVOD_LOG_LEVEL"
STREAMS = frozenset({"stdout", "stderr"})


def log_level(text: str) -> str:
    """A level name as logging knows it (any case; horovodrun's TRACE and FATAL too); ArgumentTypeError if not."""
    name = _HOROVOD_LEVELS.get(text.strip().upper(), text.strip().upper())
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: give one of {', '.join(LOG_LEVELS)}")
    return name


def environ_log_level(environ: Mapping[str, str]) -> str:
    """The level the variables give: SLUICE_LOG_LEVEL (ValueError if it names none), else Horovod's
    HOROVOD_LOG_LEVEL, where a name Horovod does not know means WARNING as there (common/logging.cc), else INFO."""
    if ENV_LOG_LEVEL in environ:
        try:
            return log_level(environ[ENV_LOG_LEVEL])
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{ENV_LOG_LEVEL}: {exc}") from None
    if HOROVOD_LOG_LEVEL in environ:
        try:
            return log_level(environ[HOROVOD_LOG_LEVEL])
        except argparse.ArgumentTypeError:
            return "WARNING"
    return "INFO"


def log_format(environ: Mapping[str, str]) -> str:
    """The format of Sluice's log lines in a process of the job (the time first with --log-with-timestamp)."""
    plain = "%(levelname)s %(name)s: %(message)s"
    return f"%(asctime)s {plain}" if environ.get(ENV_LOG_TIME) == "1" else plain


def configure_role_logging(environ: Mapping[str, str]) -> None:
    """Logging of a scheduler, server or aggregator: to stderr, Sluice's lines at the job's level (INFO unless
    told); other libraries' at INFO and above, whatever it is, so that DEBUG shows ours, not theirs."""
    try:
        level = environ_log_level(environ)
    except ValueError:
        level = "INFO"
    logging.basicConfig(level="INFO" if level == "DEBUG" else level, format=log_format(environ))
    logging.getLogger("sluice").setLevel(level)


@dataclass
class OutputOptions:
    """Where the processes' output goes besides the terminal, and how lines are marked."""

    #: per-rank log files under this directory (horovodrun's --output-filename layout); None: none
    directory: str | None = None
    #: the streams written to the files, and those shown on the terminal (torchrun's --tee, --redirects)
    files: frozenset[str] = STREAMS
    console: frozenset[str] = STREAMS
    #: the local time before every line (--prefix-output-with-timestamp)
    timestamps: bool = False
    #: the local ranks of the workers whose output the terminal shows (torchrun's --local-ranks-filter); None: all
    ranks: frozenset[int] | None = None
    #: the files this launcher already opened: a later generation or a restarted server appends to them
    opened: set[str] = field(default_factory=set)

    @property
    def split(self) -> bool:
        """Are stdout and stderr read apart (they are one stream otherwise, in the order written)?"""
        return self.directory is not None


@dataclass
class RunOptions:
    output: OutputOptions = field(default_factory=OutputOptions)
    #: the least level of the launcher's [launch] lines and the job's log lines
    log_level: str = "INFO"
    log_time: bool = False
    #: name each process and its command line as it starts (--verbose)
    verbose: bool = False
    #: MASTER_PORT wanted for the workers; None: one found free on worker 0's host
    master_port: int | None = None
    #: modules imported once by the process that forks the local workers (--preload; launch/preload.py)
    preload: tuple[str, ...] = ()

    def environ(self) -> dict[str, str]:
        """The variables every process of the job gets for these options."""
        env = {ENV_LOG_LEVEL: self.log_level}
        if self.log_time:
            env[ENV_LOG_TIME] = "1"
        return env

    @property
    def quiet(self) -> bool:
        """Are the launcher's informational lines off (--log-level WARNING and above)?"""
        return LOG_LEVELS.index(self.log_level) > LOG_LEVELS.index("INFO")


def run_options(args: argparse.Namespace, environ: Mapping[str, str]) -> RunOptions:
    """The options of `args` (after foreign_flags.translate); ValueError saying what to change."""
    tee, redirects = args.tee or frozenset(), args.redirects or frozenset()
    files, console = (tee | redirects, STREAMS - redirects) if tee or redirects else (STREAMS, STREAMS)
    directory = os.path.abspath(args.output_filename) if args.output_filename else None
    output = OutputOptions(directory, files, console, args.prefix_output_with_timestamp,
                           getattr(args, "local_ranks_filter", None))
    level = args.log_level or ("DEBUG" if args.verbose else None)
    if level is None:
        level = environ_log_level(environ)
    master_port = args.master_port
    if master_port is None and environ.get("MASTER_PORT"):
        raw = environ["MASTER_PORT"]
        if not raw.isdigit():
            raise ValueError(f"the variable MASTER_PORT={raw!r} is not a port number: unset it, or give "
                             "--master-port PORT")
        master_port = int(raw)
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"--master-port {master_port} is not a port: give one from 1 to 65535")
    preload = tuple(name.strip() for words in args.preload for name in words.split(",") if name.strip())
    for name in preload:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"--preload {name!r} is not a module name: give names as `import` takes them, "
                             "e.g. --preload torch,sluice.torch")
    return RunOptions(output, level, args.log_with_timestamp or environ.get(ENV_LOG_TIME) == "1", args.verbose,
                      master_port, preload)
