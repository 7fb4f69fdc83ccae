"""The hierarchy (collective.hierarchical) against flat sums: bytes each worker sends across hosts, and step time.

Two worker hosts of the network-namespace testbed, each running LOCAL workers, with links shaped to
--rate-mbit both ways; the scheduler on a host of its own, unshaped, and for the servers' route
SERVERS servers on hosts of their own, shaped as the workers'. Every worker trains the same MLP with
DistributedOptimizer (plain SGD; gradients summed by allreduce, or through the servers with
collective.mode = "ps"), once with the hierarchy (summed inside each host, each local rank's share
across hosts, gathered back: worker/hierarchy.py) and once without, in alternating order.

With `--local-groups sluice torch` the hierarchy also runs with the host's sum done by torch's gloo group
(collective.local_group = "torch": the device-resident path CUDA gradients take, on the CPU), to compare
both local paths in the same run.

Measured: what each worker host's link sent during the timed steps (its eth0 counter), per worker and
per step, and the median time of the timed steps. Ours is the hierarchy, the peer the same job summed
flat. Expected: through the servers, bytes across hosts divided by the local size (each worker
pushes and pulls its share only); by allreduce, a host-ordered ring already sends 2(N-1)/N of the
gradients over each host's link, and the hierarchy 2(H-1)/H, H hosts of N workers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/hierarchy.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from testbed.job import emit_result, run_sluice_job
from testbed.netbed import Netbed, ready_for

SCHEDULER, HOSTS = "sched", ("w0", "w1")
ROUTES = ("ps", "allreduce")


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """One worker: the MLP trained for warmup + steps steps; the timed steps' seconds."""
    import torch
    import torch.nn.functional as F

    import sluice.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    width = spec["width"]
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    seconds, sent = [], 0
    for step in range(spec["warmup"] + spec["steps"]):
        if step == spec["warmup"]:  # every worker starts timing together, after the start-up's traffic
            hvd.allreduce(torch.zeros(1), name="timed.start")
            sent = -host_sent()
        started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if step >= spec["warmup"]:
            seconds.append(time.perf_counter() - started)
    hvd.allreduce(torch.zeros(1), name="timed.end")
    sent += host_sent()
    from sluice.worker.torch.device_hierarchy import made
    from sluice.worker.torch.state import require

    tiers = require().hierarchy()
    result = {"seconds": seconds, "hierarchical_groups": 0 if tiers is None else tiers.groups,
              "device_resident": sum(path.summed for path in made(require())),
              "parameters": sum(p.numel() for p in model.parameters()), "local_rank": hvd.local_rank(),
              "host_sent": sent}
    hvd.shutdown()
    return result


def host_sent() -> int:
    """Bytes this worker's host has sent on its link (the testbed host's namespace has its own /sys)."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def run_job(bed: Netbed, route: str, variant: str, args: argparse.Namespace) -> dict[str, float]:
    """One job (`variant`: "flat", or the hierarchy with that local group); what each worker sent across hosts
    (MB a step) and its median step (ms)."""
    servers = [f"s{i}" for i in range(args.servers)] if route == "ps" else []
    workers = [host for host in HOSTS for _ in range(args.local)]
    hierarchical = variant != "flat"
    config = {"collective": {"hierarchical": hierarchical, "mode": route,
                             "local_group": "torch" if variant == "torch" else "sluice"}}
    spec = {"width": args.width, "warmup": args.warmup, "steps": args.steps}
    results = run_sluice_job(bed, SCHEDULER, servers, workers, config,
                             [sys.executable, "-m", "bench.hierarchy", "--worker", json.dumps(spec)],
                             timeout=args.timeout, env={"OMP_NUM_THREADS": "1"})
    sent = sum(r["host_sent"] for r in results if r["local_rank"] == 0)  # each host's counter once
    used = {r["hierarchical_groups"] > 0 for r in results}
    if used != {hierarchical}:
        raise RuntimeError(f"the {route} job {'with' if hierarchical else 'without'} the hierarchy ran "
                           f"{'without' if hierarchical else 'with'} it on some worker")
    if {r["device_resident"] > 0 for r in results} != {variant == "torch"}:
        raise RuntimeError(f"the {route} job's {variant} variant took the wrong path inside the host on some worker")
    step_ms = sorted(s * 1000 for r in results for s in r["seconds"])
    return {"mb_per_step": sent / len(workers) / args.steps / 1e6, "step_ms": step_ms[len(step_ms) // 2],
            "parameters": results[0]["parameters"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # a job's worker process
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES),
                        help="the gradients' routes to measure (default: both)")
    parser.add_argument("--local-groups", nargs="+", choices=("sluice", "torch"), default=["sluice"],
                        help="what sums inside each host with the hierarchy (collective.local_group): Sluice's "
                             "shared memory, torch's gloo group, or both in turn (default: %(default)s)")
    parser.add_argument("--local", type=int, default=2, metavar="N", help="workers a host (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="N",
                        help="servers, each on a host of its own, for the servers' route (default: %(default)s)")
    parser.add_argument("--width", type=int, default=2048, metavar="N",
                        help="the MLP's hidden width: about N*N + 74*N parameters (default: %(default)s)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, metavar="MBIT",
                        help="every shaped link's rate, both ways (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed steps (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, metavar="N", help="timed steps (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S", help="each job's deadline")
    add_common_options(parser, "the servers' route only, 1 server, a 1024-wide MLP, 2 + 3 steps, 1 repeat",
                       repeats=3)
    args = parser.parse_args(argv)
    if args.worker is not None:
        emit_result(train(json.loads(args.worker)))
        return 0
    if args.quick:
        args.routes, args.servers, args.width, args.warmup, args.steps, args.repeats = ["ps"], 1, 1024, 2, 3, 1
    if not ready_for("bench/hierarchy.py"):
        return 0
    measured: dict[tuple[str, str], list[dict[str, float]]] = {}
    variants = [*args.local_groups, "flat"]
    with Netbed() as bed:
        bed.host(SCHEDULER)
        for host in (*HOSTS, *(f"s{i}" for i in range(args.servers))):
            bed.host(host, args.rate_mbit)
        for repeat in range(args.repeats):
            for route in args.routes:
                for variant in variants if repeat % 2 == 0 else variants[::-1]:
                    got = run_job(bed, route, variant, args)
                    measured.setdefault((route, variant), []).append(got)
                    label = "flat" if variant == "flat" else f"hierarchy ({variant})"
                    progress(f"repeat {repeat + 1}/{args.repeats} {route} {label}: {got['mb_per_step']:.2f} MB a "
                             f"step sent across hosts per worker, {got['step_ms']:.1f} ms a step")
    records, rows = [], []
    for route in args.routes:
        off = measured[(route, "flat")]
        grads_mb = off[0]["parameters"] * 4 / 1e6
        extra = {"route": route, "local": args.local, "hosts": len(HOSTS), "rate_mbit": args.rate_mbit,
                 "gradient_mb": grads_mb, "repeats": args.repeats}
        for local_group in args.local_groups:
            on = measured[(route, local_group)]
            suffix = "" if local_group == "sluice" else " torch local group"
            for what, unit in (("mb_per_step", "MB sent across hosts per worker a step"), ("step_ms", "ms a step")):
                ours, peer = stats([m[what] for m in on]), stats([m[what] for m in off])
                records.append(record(f"{route} {what}{suffix}", ours, peer, "the same job summed flat", unit, "lower",
                                      local_group=local_group, **extra))
                rows.append([route, local_group, unit, ours.brief(2), peer.brief(2),
                             f"{peer.median / ours.median:.2f}x"])
        if len(args.local_groups) == 2:  # the default's choice: Sluice's shared memory against torch's gloo group
            ours, peer = stats([m["step_ms"] for m in measured[(route, "sluice")]]), stats(
                [m["step_ms"] for m in measured[(route, "torch")]])
            records.append(record(f"{route} step_ms sluice vs torch local group", ours, peer,
                                  "the hierarchy summed in the host by torch's gloo group", "ms a step", "lower",
                                  **extra))
    print_table(["route", "local group", "measure", "hierarchy", "flat", "flat / hierarchy"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
