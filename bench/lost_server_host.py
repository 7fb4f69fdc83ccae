"""How soon a server whose host goes silent is running again on its mirror's host: the scheduler's word, or ssh's."""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/lost_server_host.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from testbed.host_loss import host_bed, lose_host_in_job
from testbed.ssh import SshBed

SCRIPT = "tests/integration/scripts/cluster_train.py"
PEER_NAME = "ssh alone: the session ends after ServerAliveInterval x ServerAliveCountMax (the launcher before)"
#: the peer's scheduler.heartbeat_timeout: longer than ssh takes, so that ssh is what notices the loss
PEER_HEARTBEAT_S = 60.0
DESCRIPTION = f"""\
A job on the ssh testbed: 2 workers on the launcher's host, server 0 on h1 and server 1 on h2, the
optimizer on the workers, ps.replicas on (the launcher's default: the servers span 2 hosts). After a
few steps h2 goes silent as a host whose power went: its link down first, then every process in it
killed, so nothing it had open is closed towards the others. Measured: seconds from the loss to the
workers' `server 1 was replaced` line (the server running again on h1 from its mirror, the workers
told). Ours: the scheduler finds server 1 silent after scheduler.heartbeat_timeout
(--heartbeat-timeout) and says so; the launcher finds that h2 does not answer on its ssh port within
2 s and takes the host as lost. The peer: the same job with scheduler.heartbeat_timeout =
{PEER_HEARTBEAT_S:g} s, so that the launcher learns of the loss only when ssh ends the session (its
ServerAliveInterval 5 s x ServerAliveCountMax 3), as before the scheduler's word was heard. Pairs of
jobs in alternating order, median of --repeats."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heartbeat-timeout", type=float, default=8.0, metavar="SECONDS",
                        help="ours: scheduler.heartbeat_timeout (default: %(default)s, the setting's default)")
    parser.add_argument("--steps", type=int, default=400, metavar="N",
                        help="steps of each job; the loss comes about 1 s in (default: %(default)s)")
    add_common_options(parser, "1 pair of jobs, ours with a heartbeat timeout of 3 s, the peer's ssh probing every "
                       "second (3 s in all)", repeats=3)
    args = parser.parse_args(argv)
    args.peer_ssh = []
    if args.quick:
        args.repeats, args.heartbeat_timeout = 1, 3.0
        args.peer_ssh = ["--ssh-option", "ServerAliveInterval=1"]
    return args


def loss_to_takeover(bed: SshBed, args: argparse.Namespace, ours: bool) -> float:
    """One job: seconds from h2's silent loss to the first worker's `server 1 was replaced` line."""
    launcher, h1, h2 = (bed.netbed.hosts[name].address for name in ("launcher", "h1", "h2"))
    heartbeat = args.heartbeat_timeout if ours else PEER_HEARTBEAT_S
    sets = ["collective.mode=ps", "worker.optimizer_on=worker", "transport.chunk_bytes=4096",
            "transport.inflight_bytes=16777216", "worker.metrics_every=10", f"scheduler.heartbeat_timeout={heartbeat}"]
    job = ["--prefix-output-with-timestamp", *([] if ours else args.peer_ssh), "-H", f"{launcher}:2,{h1}:1,{h2}:1",
           "-w", "2", "-s", "2", "--server-hosts", f"{h1},{h2}", *(f"--set={s}" for s in sets), "--",
           sys.executable, SCRIPT, "--steps", str(args.steps), "--hidden", "256"]
    loss = lose_host_in_job(bed, job, "h2", r"\[worker 0\] .*transport, steps \d+-\d+:", settle_s=1.0,
                            end_s=120.0, silent=True)
    replaced = [datetime.fromisoformat(m.group(1)).timestamp()
                for m in re.finditer(r"^(\S+) \[worker \d\] .*server 1 was replaced", loss.out, re.M)]
    if loss.returncode != 0 or not replaced or "took shard 1" not in loss.out:
        raise SystemExit(f"the job failed ({loss.returncode}) or server 1 was not taken over:\n{loss.out[-3000:]}")
    probed = "taking the host as lost" in loss.out
    if probed != ours:
        raise SystemExit(f"the launcher {'did not take' if ours else 'took'} the host as lost on the scheduler's "
                         f"word:\n{loss.out[-3000:]}")
    return min(replaced) - loss.lost_at


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with host_bed("lost_server_host") as bed:
        if bed is None:
            return 0
        ours: list[float] = []
        peer: list[float] = []
        for repeat in range(args.repeats):
            for side in (True, False) if repeat % 2 == 0 else (False, True):
                (ours if side else peer).append(loss_to_takeover(bed, args, side))
            progress(f"repeat {repeat + 1}/{args.repeats}: the scheduler's word {ours[-1]:.2f} s, ssh alone "
                     f"{peer[-1]:.2f} s")
    records: list[dict[str, Any]] = [record(
        "lost-server-host", stats(ours), stats(peer), PEER_NAME, "s", "lower",
        heartbeat_timeout=args.heartbeat_timeout, peer_heartbeat_timeout=PEER_HEARTBEAT_S, steps=args.steps,
        description="seconds from a server host's silent loss to the server running again on its mirror's host")]
    print_table(["case", "the scheduler's word (s)", "ssh alone (s)", "speedup"],
                [["lost-server-host", f"{records[0]['ours']:.2f}", f"{records[0]['peer']:.2f}",
                  f"{records[0]['speedup']:.2f}x"]])
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
