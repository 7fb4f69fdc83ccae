"""bench/curve_cost.py's cases: each runs one job with CURVE on or off and returns its timed figures."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from bench import priority_training, ps_vs_allreduce
from bench.common import timed_push_pull
from bench.train_throughput import _sluice_worker as train_worker
from bench.train_throughput import demo
from sluice.transport.seal import KEY_BYTES, Opener, Sealer
from testbed.cluster import LocalCluster
from testbed.job import RESULT_PREFIX, run_sluice_job
from testbed.netbed import Netbed
from testbed.ssh import SshBed

MIB, KIB = 1 << 20, 1 << 10


@dataclass(frozen=True)
class Case:
    name: str
    where: str  # "loopback", "testbed" or "zeromq" (no Sluice in it: no target)
    unit: str
    better: str  # "higher" or "lower"
    describe: str
    #: runs one job (CURVE on or off): the figure of each timed repetition, in `unit`
    run: Callable[[bool], list[float]]
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- loopback jobs
def _pushpull_worker(nbytes: int, rounds: int, repeats: int) -> list[float]:
    return timed_push_pull(nbytes, rounds, repeats)[1]


def loopback_pushpull(args: argparse.Namespace, shm: bool) -> Case:
    nbytes = args.size * MIB
    rounds = args.rounds or max(2, 256 // args.size)

    def run(curve: bool) -> list[float]:
        config = {"transport": _transport(args, curve, shm=shm)}
        with LocalCluster(args.workers, args.servers, config) as cluster:
            results = cluster.run(_pushpull_worker, nbytes, rounds, args.inner, timeout=args.timeout)
            cluster.wait()
        return [nbytes / s / 1e9 for s in results[0]]

    name = "pushpull-shm" if shm else "pushpull-tcp"
    how = "payloads through shared memory" if shm else "transport.shm = false, payloads over TCP"
    describe = f"loopback push_pull of {args.size} MiB, {args.workers} workers x {args.servers} servers, {how}"
    return Case(name, "loopback", "GB/s", "higher", describe, run,
                {"size_mib": args.size, "rounds": rounds, "shm": shm})


def zmq_pair(args: argparse.Namespace, sealed: bool = False) -> Case:
    """ZeroMQ alone: what its CURVE costs per byte, without Sluice's own work around it; `sealed`: what
    AES-256-GCM (transport/seal.py) on the same sockets without CURVE costs instead."""
    count = max(16, args.size * 8)  # messages of 512 KiB: size * 4 MiB a repetition

    def run(on: bool) -> list[float]:
        return [_pair_cpu_per_gb(on and not sealed, count, 512 * KIB, sealed=on and sealed) for _ in range(args.inner)]

    how = ("each message sealed by the sending thread and opened by the receiving one (transport/seal.py's "
           "AES-256-GCM, no CURVE on the sockets) against the same pair in plain" if sealed else
           "ZeroMQ's I/O thread encrypts and decrypts")
    describe = (f"one pyzmq PUSH -> PULL pair in one process over TCP on loopback, {count} messages of 512 KiB, "
                f"a thread sending: CPU seconds of all threads per GB; {how}")
    return Case("zmq-pair-sealed" if sealed else "zmq-pair", "zeromq", "CPU s/GB", "lower", describe, run,
                {"messages": count, "message_kib": 512, "cipher": "AES-256-GCM" if sealed else "CURVE"})


def _pair_cpu_per_gb(curve: bool, count: int, size: int, deadline_ms: int = 30_000, sealed: bool = False) -> float:
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    key = os.urandom(KEY_BYTES)
    sealer, opener = Sealer(key), Opener(key)
    try:
        push.sndtimeo = pull.rcvtimeo = deadline_ms  # a stuck pair raises zmq.Again rather than hang the run
        if curve:
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            pull.curve_server, pull.curve_secretkey, pull.curve_publickey = True, server_secret, server_public
            push.curve_serverkey, push.curve_publickey = server_public, client_public
            push.curve_secretkey = client_secret
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        data = os.urandom(size)
        push.send(data)
        pull.recv()  # connected (and the handshake done) before the clock starts
        started = time.process_time()
        if sealed:
            sender = threading.Thread(target=lambda: [push.send_multipart(sealer.seal([b"h", data]), copy=False)
                                                      for _ in range(count)])
        else:
            sender = threading.Thread(target=lambda: [push.send(data, copy=False) for _ in range(count)])
        sender.start()
        for _ in range(count):
            if sealed:
                opener.open(pull.recv_multipart(copy=False))
            else:
                pull.recv(copy=False)
        sender.join()
        return (time.process_time() - started) / (count * size / 1e9)
    finally:
        push.close(0)
        pull.close(0)
        context.term()


def loopback_train(args: argparse.Namespace) -> Case:
    _, load_data = demo()
    x, y, _, _ = load_data()
    job = argparse.Namespace(batch_size=args.batch_size, warmup=args.warmup, steps=args.steps, repeats=args.inner)

    def run(curve: bool) -> list[float]:
        config = {"worker": {"optimizer_on": "worker"}, "transport": _transport(args, curve)}
        with LocalCluster(args.workers, args.servers, config) as cluster:
            results = cluster.run(train_worker, x, y, job, timeout=args.timeout)
            cluster.wait()
        return [s / args.steps * 1000 for s in results[0]["seconds"]]

    describe = (f"loopback training step of bench/train_throughput.py's digits model, {args.workers} workers x "
                f"{args.servers} servers, batch {args.batch_size} per worker, optimizer on the workers")
    return Case("train", "loopback", "ms/step", "lower", describe, run,
                {"batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup})


# ---------------------------------------------------------------------------- testbed jobs
def testbed_pushpull(args: argparse.Namespace, bed: Netbed) -> Case:
    nbytes = args.size * MIB
    rounds = args.rounds or max(1, 128 // args.size)
    job = argparse.Namespace(repeats=args.inner)
    argv = ps_vs_allreduce.worker_argv(job, "sluice", nbytes, rounds)
    workers, servers = [f"w{i}" for i in range(args.workers)], [f"s{i}" for i in range(args.servers)]

    def run(curve: bool) -> list[float]:
        config = {"transport": _transport(args, curve, chunk_bytes=args.chunk_bytes,
                                          inflight_bytes=args.inflight_bytes)}
        results = run_sluice_job(bed, "sched", servers, workers, config, argv, timeout=args.timeout,
                                 env={"OMP_NUM_THREADS": "1"}, echo=args.verbose)
        seconds = next(r["seconds"] for r in results if r["rank"] == 0)
        return [nbytes / s / 1e6 for s in seconds]

    describe = (f"push_pull of {args.size} MiB across testbed hosts, {args.workers} workers x {args.servers} "
                f"servers, each on its own {args.rate_mbit:g} Mbit/s link, chunk {args.chunk_bytes // KIB} KiB, "
                f"in flight {args.inflight_bytes // KIB} KiB")
    return Case("testbed-pushpull", "testbed", "MB/s", "higher", describe, run,
                {"size_mib": args.size, "rounds": rounds, "rate_mbit": args.rate_mbit,
                 "link_bound": args.rate_mbit / 8})


def _training_job(args: argparse.Namespace) -> tuple[list[str], dict[str, dict[str, Any]], str, dict[str, Any]]:
    """The worker program of priority_training.measure() with its "priority" configuration (sections),
    what it trains (for a description) and the record's extra fields."""
    job = priority_training.parse_args([
        "--workers", str(args.workers), "--servers", str(args.servers), "--global-batch", str(args.global_batch),
        "--steps", str(args.testbed_steps), "--warmup", str(args.testbed_warmup), "--repeats", str(args.inner),
        "--rate-mbit", str(args.rate_mbit), "--hidden", str(args.hidden),
    ])
    argv = [sys.executable, "-m", "bench.priority_training", "--worker", "sluice",
            "--batch", str(job.global_batch // args.workers), "--width", str(job.width), "--hidden", str(job.hidden),
            "--steps", str(job.steps), "--warmup", str(job.warmup), "--repeats", str(job.repeats)]
    params = sum(p.numel() for p in priority_training.make_model(job.width, job.hidden).parameters())
    model = f"bench/priority_training.py's VGG-like model ({params / 1e6:.2f} M parameters)"
    extra = {"global_batch": args.global_batch, "steps": args.testbed_steps, "warmup": args.testbed_warmup,
             "rate_mbit": args.rate_mbit, "parameters": params}
    return argv, priority_training.sluice_config(job, priority_training.PRIORITY), model, extra


def _transport(args: argparse.Namespace, curve: bool, **settings: Any) -> dict[str, Any]:
    """A job's transport section: security on or off, the cipher and I/O threads asked for (--cipher,
    --io-threads), `settings`."""
    return {**settings, "curve": curve, "cipher": args.cipher, "io_threads": args.io_threads}


def _with_curve(args: argparse.Namespace, base: dict[str, dict[str, Any]], curve: bool) -> dict[str, dict[str, Any]]:
    return {**base, "transport": _transport(args, curve, **base["transport"])}


def testbed_train(args: argparse.Namespace, bed: Netbed) -> Case:
    argv, base, model, extra = _training_job(args)
    workers, servers = [f"w{i}" for i in range(args.workers)], [f"t{i}" for i in range(args.servers)]

    def run(curve: bool) -> list[float]:
        results = run_sluice_job(bed, servers[0], servers, workers, _with_curve(args, base, curve), argv,
                                 timeout=args.timeout, env={"OMP_NUM_THREADS": "1"}, echo=args.verbose)
        seconds = next(r["seconds"] for r in results if r["rank"] == 0)
        return [s * 1000 for s in seconds]

    describe = (f"training step of {model}, {args.workers} workers on {args.rate_mbit:g} Mbit/s links with ToS "
                f"bands, {args.servers} servers unshaped, global batch {args.global_batch}, its 'priority' "
                "configuration")
    return Case("testbed-train", "testbed", "ms/step", "lower", describe, run, extra)


def _set_options(sections: dict[str, dict[str, Any]]) -> list[str]:
    """`--set section.key=value` for every key of `sections` (bare values, as --set reads them)."""
    out = []
    for section, values in sections.items():
        for key, value in values.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            out += ["--set", f"{section}.{key}={text}"]
    return out


def ssh_train(args: argparse.Namespace, bed: SshBed) -> Case:
    """testbed-train's job as `sluice launch -H` starts it over ssh: workers on h1..hW, servers after them."""
    argv, base, model, extra = _training_job(args)
    addresses = list(bed.hosts.values())
    layout = ["-H", ",".join(f"{a}:1" for a in addresses), "-w", str(args.workers), "-s", str(args.servers),
              "--server-hosts", ",".join(addresses[args.workers:])]

    def run(curve: bool) -> list[float]:
        # one thread per process, as testbed-train's (the launcher would pick cores / processes per host)
        done = bed.launch([*layout, *_set_options(_with_curve(args, base, curve)), "--", *argv], timeout=args.timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
        if args.verbose:
            print(done.stdout, flush=True)
        found = re.findall(rf"^\[worker 0\] {RESULT_PREFIX}(.*)$", done.stdout, re.M)
        if done.returncode != 0 or not found:
            tail = "\n".join(f"    {line}" for line in done.stdout.splitlines()[-30:])
            raise RuntimeError(f"sluice launch over ssh (transport.curve = {curve}) exited {done.returncode} "
                               f"without worker 0's {RESULT_PREFIX.strip()} line; its last lines:\n{tail}")
        return [s * 1000 for s in json.loads(found[-1])["seconds"]]

    describe = (f"training step of {model} launched over OpenSSH (sluice launch -H), {args.workers} workers on "
                f"hosts of their own with {args.rate_mbit:g} Mbit/s links and ToS bands, {args.servers} servers on "
                f"unshaped hosts (--server-hosts), the scheduler on the launcher's, global batch "
                f"{args.global_batch}, the 'priority' configuration")
    return Case("ssh-train", "testbed", "ms/step", "lower", describe, run, {**extra, "launched": "ssh"})
