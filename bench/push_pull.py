"""Sluice push_pull algorithm bandwidth against raw pyzmq echo and torch.distributed gloo all_reduce."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/push_pull.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.distributed as dist
import zmq

from bench.common import (
    Stats,
    add_common_options,
    free_port,
    keep_alive,
    print_table,
    progress,
    record,
    stats,
    timed_push_pull,
    write_json,
)
from sluice.transport.config import TransportConfig
from sluice.worker.plan.fusion import FusionPlan, plan_fusion
from testbed.children import Children
from testbed.cluster import LocalCluster

MIB = 1 << 20
CHUNK = MIB  # the raw pyzmq peer sends 1 MiB messages, like Sluice's default chunk size
GLOO = "torch.distributed gloo all_reduce"
FUSION_BUFFER = 16 * MIB  # the bucket case's fusion buffer size (plan_fusion's buffer_bytes)

DESCRIPTION = """\
Algorithm bandwidth (bytes of the tensor per worker / time of one round) of one float32 tensor:

  sluice  W workers push_pull the tensor through S servers (LocalCluster, worker.client.Client),
          pushing from an array in registered memory (Client.alloc: no copy into the send ring)
  plain   the same from an ordinary numpy array (one copy into the send ring per chunk)
  bucket  the same bytes laid out as torch gradients will be (issue 7): a BERT-like table of
          about 150 tensors (big weights, small biases and norms) whose sizes sum to the size,
          given slots in backward order in one flat buffer from Client.alloc, cut by
          worker.plan.fusion.plan_fusion with a 16 MiB fusion buffer; each group is declared as a
          tensor and push_pulled in place from its view of the buffer (client.push_pull(name,
          view, view)), every group at once, then all are waited for
  zmq     W processes each send the tensor as 1 MiB zero-copy PUSH messages over tcp 127.0.0.1 to
          S sink processes (chunk i to sink i mod S, as Sluice spreads chunks over its servers),
          which echo every message back on a PUSH socket per worker (the traffic of a push and a
          pull, without the summing)
  gloo    W processes run torch.distributed all_reduce (gloo backend) on the same tensor

Every process does one untimed warm-up round, then each repetition times ROUNDS rounds between
two barriers (rank 0's clock). The JSON record's peer is gloo; plain, bucket and zmq are extra
fields (ratio_plain and ratio_bucket against the same gloo figure).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], metavar="MIB",
                        help="tensor sizes in MiB of float32 (default: %(default)s)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], metavar="W",
                        help="worker counts; every size runs with every count (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=0, metavar="S",
                        help="Sluice server processes and zmq sink processes; 0 means as many as workers "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=0, metavar="R",
                        help="rounds timed per repetition; 0 picks max(2, 256 MiB / size) (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one measurement after this long (default: %(default)s)")
    add_common_options(parser, quick="16 MiB, 2 workers, 2 repeats of 2 rounds (overrides those options)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.workers, args.repeats, args.rounds = [16], [2], 2, 2
    if min(args.sizes) < 1 or min(args.workers) < 1 or args.repeats < 1 or args.servers < 0 or args.rounds < 0:
        parser.error("sizes, workers and repeats must be positive; servers and rounds not negative")
    return args


def rounds_for(size_mib: int, rounds: int) -> int:
    return rounds if rounds > 0 else max(2, 256 // size_mib)


# ---------------------------------------------------------------------------- sluice
def _sluice_worker(nbytes: int, rounds: int, repeats: int, registered: bool) -> list[float]:
    """Runs in each forked worker: per-round seconds of each repetition (rank 0's clock)."""
    return timed_push_pull(nbytes, rounds, repeats, registered)[1]


def measure_sluice(
    nbytes: int, workers: int, servers: int, rounds: int, repeats: int, timeout: float, registered: bool
) -> list[float]:
    with LocalCluster(workers, servers) as cluster:
        results = cluster.run(_sluice_worker, nbytes, rounds, repeats, registered, timeout=timeout)
        cluster.wait()
    times: list[float] = results[0]
    return times


# ---------------------------------------------------------------------------- sluice, gradient buckets
#: one encoder block of a BERT-like model: (name, weight units or None, floats of a small tensor)
_BLOCK = [
    ("attn.qkv.weight", 3, 0), ("attn.qkv.bias", None, 2304), ("attn.out.weight", 1, 0), ("attn.out.bias", None, 768),
    ("ln1.weight", None, 768), ("ln1.bias", None, 768), ("mlp.fc1.weight", 4, 0), ("mlp.fc1.bias", None, 3072),
    ("mlp.fc2.weight", 4, 0), ("mlp.fc2.bias", None, 768), ("ln2.weight", None, 768), ("ln2.bias", None, 768),
]
_BLOCKS = 12
_EMBEDDING_UNITS = 3


def model_table(nbytes: int) -> list[tuple[str, int]]:
    """(name, float32 count) of a BERT-like model whose tensors sum to exactly `nbytes`: 12 blocks of
    12 tensors after an embedding, weights scaled to the size, biases and norms of BERT-base's widths.
    Every count is a multiple of 16 floats, so slots need no padding and the fused buffer is `nbytes`."""
    small = _BLOCKS * sum(n for _, units, n in _BLOCK if units is None) + 2 * 768
    units = _EMBEDDING_UNITS + _BLOCKS * sum(u for _, u, _ in _BLOCK if u is not None)
    unit = (nbytes // 4 - small) // units // 16 * 16
    if unit < 16:
        raise ValueError(f"{nbytes} bytes is too small for the bucket case's model table")
    table = [("embedding.weight", _EMBEDDING_UNITS * unit)]
    for block in range(_BLOCKS):
        table += [(f"block{block}.{name}", units_ * unit if units_ is not None else n) for name, units_, n in _BLOCK]
    table += [("final_ln.weight", 768), ("final_ln.bias", 768)]
    name, count = table[0]
    table[0] = (name, count + nbytes // 4 - sum(n for _, n in table))  # the embedding takes what rounding left
    return table


def bucket_plan(nbytes: int) -> tuple[list[tuple[str, int]], FusionPlan]:
    """The model table and its fusion plan: backward produces gradients from the last layer to the first."""
    table = model_table(nbytes)
    plan = plan_fusion([4 * n for _, n in table], list(reversed(range(len(table)))), FUSION_BUFFER)
    if plan.total_bytes != nbytes:  # bandwidth is quoted for `nbytes`: padding would go uncounted
        raise ValueError(f"the bucket layout takes {plan.total_bytes} bytes for a {nbytes}-byte case")
    return table, plan


def _bucket_worker(nbytes: int, rounds: int, repeats: int) -> list[float]:
    """In each Sluice worker: push_pull every fusion group in place from one registered flat buffer."""
    from sluice.worker.node import WorkerNode

    _, plan = bucket_plan(nbytes)
    node = WorkerNode()
    client = node.ps
    flat = client.alloc((plan.total_bytes // 4,), "float32")
    grads = [flat[s.offset // 4 : (s.offset + s.nbytes) // 4] for s in plan.slots]  # what torch's .grad would be
    groups = [(f"bucket.{g.index}", flat[g.start // 4 : g.end // 4]) for g in plan.groups]
    # declared last group first: the plan's priority is the declaration order, and the last group in
    # backward order holds the first layers, which the next forward pass needs first
    client.declare([(name, (view.size,), "float32", None) for name, view in reversed(groups)])
    for grad in grads:
        grad[:] = 1.0

    def one_round() -> None:
        handles = [client.push_pull(name, view, view) for name, view in groups]  # in backward order
        for handle in handles:
            handle.wait()

    one_round()
    if not all(bool(np.all(grad == client.size)) for grad in grads):
        raise AssertionError(f"bucket push_pull returned a wrong sum (expected {client.size} everywhere)")
    flat[:] = 0.0  # in place, sums of ones would grow without bound; sums of zeros stay finite
    seconds = []
    for rep in range(repeats):
        node.barrier(f"start.{rep}")
        started = time.perf_counter()
        for _ in range(rounds):
            one_round()
        node.barrier(f"end.{rep}")
        seconds.append((time.perf_counter() - started) / rounds)
    node.close()
    return seconds


def measure_bucket(nbytes: int, workers: int, servers: int, rounds: int, repeats: int, timeout: float) -> list[float]:
    with LocalCluster(workers, servers) as cluster:
        results = cluster.run(_bucket_worker, nbytes, rounds, repeats, timeout=timeout)
        cluster.wait()
    times: list[float] = results[0]
    return times


# ---------------------------------------------------------------------------- raw pyzmq
def _zmq_sink(sink: int, workers: int, messages: int, ports: Any) -> int:
    """Echo every message from worker w's PULL socket back on worker w's PUSH socket, `messages` in all."""
    context = zmq.Context()
    try:
        pulls, pushes, bound = [], [], []
        for _ in range(workers):
            pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
            bound.append((pull.bind_to_random_port("tcp://127.0.0.1"), push.bind_to_random_port("tcp://127.0.0.1")))
            pulls.append(pull)
            pushes.append(push)
        ports.put((sink, bound))
        poller = zmq.Poller()
        for pull in pulls:
            poller.register(pull, zmq.POLLIN)
        index = {pull: w for w, pull in enumerate(pulls)}
        left = messages
        while left:
            for sock, _ in poller.poll():
                frame = sock.recv(copy=False)
                pushes[index[sock]].send(frame, copy=False)
                left -= 1
        return messages
    finally:
        context.destroy(linger=10_000)


def _zmq_worker(
    rank: int, ports: list[tuple[int, int]], nbytes: int, rounds: int, repeats: int, barrier: Any
) -> list[float]:
    """Send chunk i to sink i % S (as Sluice spreads chunks over servers) and take every echo back."""
    context = zmq.Context()
    try:
        pushes, pulls = [], []
        for port_in, port_out in ports:
            push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
            push.connect(f"tcp://127.0.0.1:{port_in}")
            pull.connect(f"tcp://127.0.0.1:{port_out}")
            pushes.append(push)
            pulls.append(pull)
        data, out = np.full(nbytes // 4, rank + 1, np.float32), np.zeros(nbytes // 4, np.float32)
        source, target = data.data.cast("B"), out.view(np.uint8)
        chunks = [(offset, pushes[i % len(ports)], pulls[i % len(ports)]) for i, offset in
                  enumerate(range(0, nbytes, CHUNK))]

        def one_round() -> None:
            for offset, push, _ in chunks:
                push.send(source[offset : offset + CHUNK], copy=False)
            for offset, _, pull in chunks:  # each sink answers in the order it was sent to
                frame = pull.recv(copy=False)
                np.copyto(target[offset : offset + len(frame)], np.frombuffer(frame.buffer, np.uint8))

        one_round()
        if not np.array_equal(out, data):
            raise AssertionError("the sinks echoed different bytes")
        times = []
        for _ in range(repeats):
            barrier.wait(60)
            started = time.perf_counter()
            for _ in range(rounds):
                one_round()
            barrier.wait(60)
            times.append((time.perf_counter() - started) / rounds)
        return times
    finally:
        context.destroy(linger=0)


def measure_zmq(nbytes: int, workers: int, sinks: int, rounds: int, repeats: int, timeout: float) -> list[float]:
    chunks = -(-nbytes // CHUNK)
    with Children() as children:
        ports = children.queue()
        for s in range(sinks):
            per_worker = len(range(s, chunks, sinks)) * (1 + repeats * rounds)
            children.start(f"sink {s}", _zmq_sink, s, workers, workers * per_worker, ports)
        bound = dict(ports.get(timeout=30) for _ in range(sinks))
        barrier = children.barrier(workers)
        for w in range(workers):
            children.start(f"worker {w}", _zmq_worker, w, [bound[s][w] for s in range(sinks)], nbytes, rounds,
                           repeats, barrier)
        keys = [*(f"sink {s}" for s in range(sinks)), *(f"worker {w}" for w in range(workers))]
        results = children.collect(keys, timeout)
    times: list[float] = results["worker 0"]
    return times


# ---------------------------------------------------------------------------- gloo
def _gloo_worker(rank: int, world: int, port: int, nbytes: int, rounds: int, repeats: int) -> list[float]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    tensor = torch.ones(nbytes // 4)
    keep_alive(tensor)  # no destroy_process_group either: see keep_alive
    dist.all_reduce(tensor)
    if not bool((tensor == world).all()):
        raise AssertionError("all_reduce returned a wrong sum")
    tensor.zero_()  # sums of zeros stay finite however many rounds run
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(tensor)
        dist.barrier()
        times.append((time.perf_counter() - started) / rounds)
    return times


def measure_gloo(nbytes: int, workers: int, rounds: int, repeats: int, timeout: float) -> list[float]:
    port = free_port()
    with Children() as children:
        for w in range(workers):
            children.start(f"rank {w}", _gloo_worker, w, workers, port, nbytes, rounds, repeats)
        results = children.collect([f"rank {w}" for w in range(workers)], timeout)
    times: list[float] = results["rank 0"]
    return times


# ---------------------------------------------------------------------------- driver
def bandwidth(nbytes: int, seconds: list[float]) -> Stats:
    return stats([nbytes / t / 1e9 for t in seconds])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cases = [(size, w) for w in args.workers for size in args.sizes]
    progress(f"push_pull bandwidth: {len(cases)} cases, {args.repeats} repeats each, GB/s = 1e9 bytes/s")
    progress(f"sluice runs with the default {TransportConfig()}")
    rows, records = [], []
    started = time.perf_counter()
    for size, workers in cases:
        nbytes, servers = size * MIB, args.servers or workers
        rounds = rounds_for(size, args.rounds)
        case = f"{size}MiB-w{workers}-s{servers}"
        measured: dict[str, Stats] = {}
        for name in ("sluice", "plain", "bucket", "zmq", "gloo"):
            t0 = time.perf_counter()
            if name in ("sluice", "plain"):
                registered = name == "sluice"
                seconds = measure_sluice(nbytes, workers, servers, rounds, args.repeats, args.timeout, registered)
            elif name == "bucket":
                seconds = measure_bucket(nbytes, workers, servers, rounds, args.repeats, args.timeout)
            elif name == "zmq":
                seconds = measure_zmq(nbytes, workers, servers, rounds, args.repeats, args.timeout)
            else:
                seconds = measure_gloo(nbytes, workers, rounds, args.repeats, args.timeout)
            measured[name] = bandwidth(nbytes, seconds)
            progress(f"  {case:<16} {name:<6} {measured[name].brief()} GB/s  ({time.perf_counter() - t0:.1f} s)")
        ours, plain, zmq_, gloo = measured["sluice"], measured["plain"], measured["zmq"], measured["gloo"]
        bucket = measured["bucket"]
        table, plan = bucket_plan(nbytes)
        rows.append([
            case, str(rounds), ours.brief(), plain.brief(), bucket.brief(), zmq_.brief(), gloo.brief(),
            f"{ours.median / gloo.median:.2f}x", f"{plain.median / gloo.median:.2f}x",
            f"{bucket.median / gloo.median:.2f}x", f"{ours.median / zmq_.median:.2f}x",
        ])
        records.append(record(
            case, ours, gloo, GLOO, "GB/s", plain=plain.median, plain_min=plain.low, plain_max=plain.high,
            ratio_plain=plain.median / gloo.median, bucket=bucket.median, bucket_min=bucket.low,
            bucket_max=bucket.high, ratio_bucket=bucket.median / gloo.median, bucket_tensors=len(table),
            bucket_groups=len(plan.groups), bucket_group_bytes=[g.nbytes for g in plan.groups],
            fusion_buffer_bytes=FUSION_BUFFER, zmq=zmq_.median, zmq_min=zmq_.low, zmq_max=zmq_.high,
            ratio_zmq=ours.median / zmq_.median, size_mib=size, workers=workers, servers=servers,
            rounds=rounds, repeats=args.repeats,
        ))
    progress(f"\nalgorithm bandwidth in GB/s, median [min..max] of {args.repeats} repeats "
             f"({time.perf_counter() - started:.0f} s in all)")
    print_table(
        ["case", "rounds", "sluice", "plain", "bucket", "zmq echo", "gloo", "sluice/gloo", "plain/gloo",
         "bucket/gloo", "sluice/zmq"], rows,
    )
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
