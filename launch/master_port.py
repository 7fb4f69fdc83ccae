"""MASTER_PORT for a job's workers: free on worker 0's host, checked there (here by binding, elsewhere over ssh/srun).

torch.distributed's rendezvous (a DDP script's init_process_group, ddp_hook) listens on MASTER_PORT
of worker 0's host, so that is where the port must be free: a port free on the launcher's machine
says nothing about another host. On another host the check is `python -m sluice.launch.master_port
PORT` there, started the way the roles are (launch/reach.py): it binds the port as the rendezvous
will, prints `SLUICE_FREE_PORT <port>` and exits 0, or says why not and exits 1. Port 0 asks it
for a port the OS finds free there. Another program may still take the port before the workers
do; the workers' own error then names it.
"""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.launch.spawner import Spawner

FREE_PREFIX = "SLUICE_FREE_PORT "
PROBE_TIMEOUT = 30.0


class MasterPortError(ValueError):
    """The port cannot be used on worker 0's host; the text says what to do."""


def bind_probe(port: int) -> int:
    """Bind `port` (0: any) on every IPv4 address of this host, as torch's store does (with SO_REUSEADDR,
    so a port in TIME_WAIT counts as free); the port bound, or OSError."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", port))
        return int(probe.getsockname()[1])


def _taken(port: int, where: str, why: str) -> MasterPortError:
    if port == 0:
        return MasterPortError(f"no free port for MASTER_PORT on {where}: {why}")
    return MasterPortError(f"MASTER_PORT {port} cannot be used on {where} ({why}): give another with "
                           "--master-port PORT (or MASTER_PORT), or leave both out and the launcher picks a "
                           "free one there")


def parse_answer(output: str, wanted: int) -> int | None:
    """The port in the probe's answer, if it is one (and the one wanted, when one was)."""
    for line in output.splitlines():
        if line.startswith(FREE_PREFIX):
            text = line[len(FREE_PREFIX) :].strip()
            if text.isdigit() and 0 < int(text) < 65536 and wanted in (0, int(text)):
                return int(text)
    return None


async def choose(spawner: Spawner, wanted: int | None) -> int:
    """The port for MASTER_PORT: `wanted` once checked free on worker 0's host, or one found free there."""
    port = wanted or 0
    plan = spawner.plan
    host = None if plan is None else plan.place("worker", 0).host
    if plan is None or host is None or not plan.is_remote(host):
        try:
            return bind_probe(port)
        except OSError as exc:
            raise _taken(port, "this machine (worker 0's host)", exc.strerror or str(exc)) from None
    code, output = await spawner.run_there(host, ["-m", "sluice.launch.master_port", str(port)], PROBE_TIMEOUT)
    found = parse_answer(output, port)
    if code == 0 and found is not None:
        return found
    last = " | ".join(output.strip().splitlines()[-3:]) or "no output"
    if code == 1 and f"port {port}: " in output:  # the probe ran there, and the port is not to be had
        raise _taken(port, f"worker 0's host {host}", last.split(": ", 1)[-1])
    waited = f"took over {PROBE_TIMEOUT:g} s" if code is None else f"failed (exit {code}: {last})"
    raise MasterPortError(f"checking MASTER_PORT on worker 0's host {host} {waited}: check that `ssh {host} "
                          "true` works without a password (or that srun reaches it)")


def main(argv: list[str]) -> int:
    try:
        port = int(argv[0]) if len(argv) == 1 else -1
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        print("usage: python -m sluice.launch.master_port PORT (0: any); `sluice launch` runs it", file=sys.stderr)
        return 2
    try:
        print(f"{FREE_PREFIX}{bind_probe(port)}", flush=True)
    except OSError as exc:
        print(f"port {port}: {exc.strerror or exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just handed out (torch.distributed's rendezvous in DDP scripts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
