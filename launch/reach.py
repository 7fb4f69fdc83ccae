"""How the launcher reaches another host: the ssh or srun command, the remote stub's header, host addresses.

A role on another host is started by a local `ssh HOST ...` (or, inside a SLURM allocation, `srun
--nodelist=HOST ...`) that runs `python -m sluice.launch.remote` there (launch/remote.py). What the
role needs (its argv, environment, working directory and the job secret) travels as one JSON line
on that command's stdin: never in a command line, which `ps` shows every user of both hosts. As
horovodrun and DeepSpeed assume, every host has the project and its Python at the same paths (a
shared file system, or the same image), so the launcher's interpreter and working directory are
used as they are.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sluice.launch.hosts import HostsError

#: variables that describe the launcher's own session or host, not the job: not forwarded
_NOT_FORWARDED = re.compile(
    r"(HOSTNAME|HOST|PWD|OLDPWD|SHLVL|_|DISPLAY|XAUTHORITY|TERM|TERMCAP|COLUMNS|LINES|LS_COLORS|MAIL|"
    r"SSH_.*|TMUX.*|STY|WINDOW|BASH_FUNC_.*|XDG_.*|DBUS_.*|SLURM_.*|SRUN_.*|SLUICE_SECRET_FD)")
#: a session whose peer has been silent this long (5 s x 3) is over: the lost host is named promptly
_SSH_DEFAULTS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=5", "ServerAliveCountMax=3")


@dataclass(frozen=True)
class Reach:
    """How to start a process on another host."""

    method: str = "ssh"  # "ssh" or "srun"
    ssh_port: int | None = None
    ssh_identity: str | None = None
    #: extra `-o KEY=VALUE` options for ssh, e.g. UserKnownHostsFile=PATH
    ssh_options: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.method not in ("ssh", "srun"):
            raise ValueError(f"the remote start method must be ssh or srun, got {self.method!r}")
        for option in self.ssh_options:
            if "=" not in option or option.startswith("="):
                raise ValueError(f"--ssh-option {option!r} must look like KEY=VALUE, e.g. UserKnownHostsFile=PATH")


def stub_argv(reach: Reach, host: str, python: str, cwd: str) -> list[str]:
    """The local command that runs the remote stub on `host`, reading its header from stdin."""
    if reach.method == "srun":
        # one task on the named node, inside the allocation; --kill-on-bad-exit so SLURM ends the step
        # with the task; stdin goes to the task (srun's default for one task)
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--kill-on-bad-exit=1", "--quiet",
                f"--chdir={cwd}", python, "-m", "sluice.launch.remote"]
    argv = ["ssh", "-T"]  # no terminal: stdin carries the header and then the session's life
    for option in (*reach.ssh_options, *_SSH_DEFAULTS):  # ssh takes an option's first value: the user's win
        argv += ["-o", option]
    if reach.ssh_port is not None:
        argv += ["-p", str(reach.ssh_port)]
    if reach.ssh_identity is not None:
        argv += ["-i", reach.ssh_identity]
    argv += [host, f"cd {shlex.quote(cwd)} && exec {shlex.quote(python)} -m sluice.launch.remote"]
    return argv


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables a remote role gets (its own session's, like SSH_* or PWD, stay behind)."""
    return {k: v for k, v in environ.items() if not _NOT_FORWARDED.fullmatch(k)}


def header_line(argv: Sequence[str], env: Mapping[str, str], cwd: str, secret: bytes, split: bool = False,
                outlive: bool = False) -> bytes:
    """The one line launch/remote.py reads first (`split`: the role's stderr apart, on the session's stderr;
    `outlive`: the role outlives the session's end)."""
    header: dict[str, object] = {"argv": list(argv), "env": dict(env), "cwd": cwd, "secret": secret.hex()}
    if split:
        header["split"] = True
    if outlive:
        header["outlive"] = True
    return json.dumps(header, separators=(",", ":")).encode() + b"\n"


def host_address(name: str) -> str:
    """The IPv4 address `name` resolves to here (the address its processes listen on); HostsError if none."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise HostsError(f"host {name!r} does not resolve to an address ({exc}): check the name, or give "
                         "its IP address in -H or the hostfile") from None
    return str(found[0][4][0])


def outward_address(toward: str) -> str:
    """The address of this machine that packets to `toward` leave from (no packet is sent): where
    processes on the launcher's host listen so that the other hosts can reach them."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((toward, 9))
        except OSError as exc:
            raise HostsError(f"no route from this machine to {toward} ({exc}): check the host's address") from None
        return str(probe.getsockname()[0])


def is_this_machine(address: str) -> bool:
    """Is `address` one of this machine's own (a socket can bind it)? Processes for it start without ssh."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
        return True
