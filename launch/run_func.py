"""`sluice.run(func, ...)`, Horovod's `horovod.run`: a job of `func` on this host's workers, their return values.

The caller's function, its arguments and, later, each worker's return value pass through files in a folder of
the caller's (mode 0700, removed at the end), pickled with cloudpickle as Horovod pickles them: never over the
network, so the workers run on this host only. The job itself is `sluice launch` with horovodrun's flags for the
arguments, running `python -m sluice.launch.run_task FOLDER` as each worker; its output is copied to this
process's sys.stdout and sys.stderr (a notebook shows it), and it dies with the thread that called.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from sluice.launch.children import death_signal_hook
from sluice.launch.hosts import HostsError, parse_host_list, parse_hostfile
from sluice.launch.reach import host_address, is_this_machine
from sluice.launch.run_options import ENV_LOG_LEVEL, HOROVOD_LOG_LEVEL
from sluice.launch.run_task import FOLDER_PREFIX, RESULT, TASK, pickler

_LAUNCHER_SAYS = "sluice launch: "
#: how long the launcher may take to end the job after this process is interrupted, before it is killed
_STOP_S = 30.0


def launch_argv(num_proc: int, options: dict[str, Any]) -> list[str]:
    """horovodrun's flags for run()'s arguments (None: not given), as `sluice launch` takes them."""
    flags = {"hosts": "-H", "hostfile": "-hostfile", "min_num_proc": "--min-np", "max_num_proc": "--max-np",
             "slots": "--slots-per-host", "reset_limit": "--reset-limit",
             "host_discovery_script": "--host-discovery-script", "start_timeout": "--start-timeout",
             "ssh_port": "-p", "ssh_identity_file": "-i", "output_filename": "--output-filename",
             "mpi_args": "--mpi-args"}
    switches = {"disable_cache": "--disable-cache", "verbose": "--verbose", "use_gloo": "--gloo", "use_mpi": "--mpi"}
    argv = ["-np", str(num_proc)]
    for name, flag in flags.items():
        if options.get(name) is not None:
            argv += [flag, str(options[name])]
    argv += [flag for name, flag in switches.items() if options.get(name)]
    if options.get("cooldown_range") is not None:
        argv += ["--blacklist-cooldown-range", *(str(v) for v in options["cooldown_range"])]
    if options.get("network_interfaces"):
        argv += ["--network-interfaces", ",".join(options["network_interfaces"])]
    return argv


def check_local(hosts: str | None, hostfile: str | None) -> None:
    """ValueError unless every host named is this machine: the function reaches its workers through a file here."""
    try:
        named = parse_host_list(hosts) if hosts else []
        if hostfile:
            named = parse_hostfile(Path(hostfile).read_text(), hostfile)
        others = [h.name for h in named if not is_this_machine(host_address(h.name))]
    except (HostsError, OSError) as exc:
        raise ValueError(str(exc)) from None
    if others:
        raise ValueError(f"sluice.run starts its workers on this host only (the function reaches them through a "
                         f"file here, never pickled over the network), and {', '.join(others)} is another: put "
                         "the function in a script and run `sluice launch -H ...` for several hosts")


def _copy(stream: IO[bytes], target: Callable[[], IO[str]], said: list[str]) -> None:
    """Copy a pipe's lines to a text stream looked up at each line (sys.stdout can be swapped by a notebook);
    the launcher's own lines (`sluice launch: ...`) are kept in `said` too."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if line.startswith(_LAUNCHER_SAYS):
            said.append(line.removeprefix(_LAUNCHER_SAYS).strip())
        out = target()
        out.write(line)
        out.flush()


def run_job(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], num_proc: int,
            results: int, options: dict[str, Any], launch_args: Sequence[str] = (),
            executable: str | None = None) -> list[Any]:
    """Run the job; the first `results` ranks' return values, or RuntimeError when a process failed."""
    check_local(options.get("hosts"), options.get("hostfile"))
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    try:
        with open(folder / TASK, "wb") as task:
            pickler().dump((func, tuple(args), dict(kwargs)), task)
        worker = [executable or sys.executable, "-m", "sluice.launch.run_task", str(folder)]
        # Horovod's default level is WARNING: a notebook sees the workers' output and the failures, not the
        # launcher's configuration or the workers' INFO lines, unless verbose or a level variable asks
        quiet = [] if options.get("verbose") or {ENV_LOG_LEVEL, HOROVOD_LOG_LEVEL} & set(os.environ) \
            else ["--log-level", "WARNING"]
        argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *launch_argv(num_proc, options), *quiet,
                *launch_args, "--", *worker]
        said: list[str] = []
        code = _supervise(argv, said)
        if code != 0:
            first = f"The first to do so: {said[0].split('; stopping')[0]}" if said else f"sluice launch exited {code}"
            raise RuntimeError("sluice.run: one or more processes exited with non-zero status, thus causing the "
                               f"job to be terminated. {first}")
        values = []
        for rank in range(results):
            try:
                with open(folder / RESULT.format(rank), "rb") as result:
                    values.append(pickle.load(result))  # written by our own workers, on this host
            except FileNotFoundError:
                raise RuntimeError(f"sluice.run: worker {rank} ended without returning from the function") from None
        return values
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _supervise(argv: list[str], said: list[str]) -> int:
    """Run the launcher to its end, its output copied here; Ctrl-C here stops its job (as Ctrl-C stops it)."""
    launcher = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=death_signal_hook())
    assert launcher.stdout is not None and launcher.stderr is not None
    copiers = [threading.Thread(target=_copy, args=(launcher.stdout, lambda: sys.stdout, said), daemon=True),
               threading.Thread(target=_copy, args=(launcher.stderr, lambda: sys.stderr, said), daemon=True)]
    for copier in copiers:
        copier.start()
    try:
        code = launcher.wait()
    except BaseException:  # KeyboardInterrupt: the job is stopped as the launcher stops it on Ctrl-C
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        raise
    finally:
        for copier in copiers:
            copier.join(5.0)
        launcher.stdout.close()
        launcher.stderr.close()
    return code


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int = 1, min_num_proc: int | None = None, max_num_proc: int | None = None,
        slots: int | None = None, reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None,
        hosts: str | None = None, hostfile: str | None = None, host_discovery_script: str | None = None,
        start_timeout: int | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None, verbose: bool | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, network_interfaces: Sequence[str] | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None, *, launch_args: Sequence[str] = ()) -> list[Any]:
    """Run `func(*args, **kwargs)` in each of `num_proc` worker processes of a job on this host, as
    `horovod.run` does; the list of their return values, by rank (only the first `min_num_proc` in an
    elastic job). `func` and the values must pickle (cloudpickle takes functions of __main__, lambdas and
    closures). RuntimeError if a process of the job exits with a non-zero status; the others are stopped.
    Horovod's arguments mean what horovodrun's flags of the same names mean to `sluice launch`; `hosts`,
    `hostfile` may name this machine only (ValueError otherwise). `launch_args`, Sluice's own: more
    `sluice launch` flags, e.g. ["-s", "2"] for two parameter servers or ["--preload", "torch"]."""
    if network_interface:
        network_interfaces = network_interface.split(",")
        _deprecated("network_interfaces", "network_interface")
    if np is not None:
        num_proc = np
        _deprecated("num_proc", "np")
    if min_np is not None:
        min_num_proc = min_np
        _deprecated("min_num_proc", "min_np")
    if max_np is not None:
        max_num_proc = max_np
        _deprecated("max_num_proc", "max_np")
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")  # Horovod's words, as there
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    options = {"hosts": hosts, "hostfile": hostfile, "min_num_proc": min_num_proc, "max_num_proc": max_num_proc,
               "slots": slots, "reset_limit": reset_limit, "cooldown_range": cooldown_range,
               "host_discovery_script": host_discovery_script, "start_timeout": start_timeout,
               "ssh_port": ssh_port, "ssh_identity_file": ssh_identity_file, "disable_cache": disable_cache,
               "output_filename": output_filename, "verbose": verbose, "use_gloo": use_gloo, "use_mpi": use_mpi,
               "mpi_args": mpi_args, "network_interfaces": network_interfaces}
    results = min_num_proc if min_num_proc is not None else num_proc
    return run_job(func, args, kwargs or {}, num_proc, results, options, launch_args, executable)


def _deprecated(new: str, old: str) -> None:
    warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=3)
