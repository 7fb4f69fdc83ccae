"""ps.replicas' two ways to keep N copies, measured on shaped links: primary-backup (Sluice's) against a chain.

Three testbed hosts, each running one server's mirror traffic and nothing else, over raw pyzmq
PUSH/PULL sockets (the topology alone, without Sluice's checks, files and optimizer). Every round, a
primary sends its STATE-byte state, cut into CHUNK-byte messages, to its 2 holders, the next servers
in rank order (scheduler/recovery.py `holders`):

  primary-backup  the primary sends every chunk to both holders; each acknowledges the round once it
                  has copied all of its chunks (ps/mirror.py `MirrorSender`: Sluice's way)
  chain           the primary sends every chunk to the first holder, which copies it and forwards it
                  to the second (chunk by chunk, so the chain pipelines); the second, the tail,
                  acknowledges the round to the primary (chain replication, as Li et al.'s PS)

A round ends at the primary when its acknowledgements are in; the next starts then. Two cases:
`sharded`, every server a primary at once (a sharded job: each server also holds two others' copies),
and `one primary` (the others only hold). Ours is primary-backup, the peer the chain; ms per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/mirror_topology.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import zmq

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from testbed.netbed import Netbed, ready_for

MIB = 1 << 20
PORT = 29900
SERVERS, COPIES = 3, 2
TOPOLOGIES = ("primary-backup", "chain")
CASES = {"sharded": (0, 1, 2), "one primary": (0,)}


def holders(primary: int) -> list[int]:
    return [(primary + k) % SERVERS for k in range(1, COPIES + 1)]


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    """One server's process: its rounds as a primary (if it is one) and its holding of the others' chunks."""
    me, addresses, topology, primaries = spec["me"], spec["addresses"], spec["topology"], spec["primaries"]
    chunks, chunk_bytes, rounds = spec["state"] // spec["chunk"], spec["chunk"], spec["warmup"] + spec["rounds"]
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(f"tcp://{addresses[me]}:{PORT}")
    out: dict[int, zmq.Socket[bytes]] = {}
    for rank, address in enumerate(addresses):
        if rank != me:
            out[rank] = context.socket(zmq.PUSH)
            out[rank].setsockopt(zmq.SNDHWM, 0)
            out[rank].connect(f"tcp://{address}:{PORT}")
    state = np.random.default_rng(me).integers(0, 255, spec["state"], np.uint8)
    copies = {p: np.empty(spec["state"], np.uint8) for p in primaries if me in holders(p)}
    filled: dict[tuple[int, int], int] = {}
    time.sleep(max(0.0, spec["start_at"] - time.time()))
    seconds: list[float] = []
    acks: dict[int, int] = {}
    finished: set[int] = set()
    started, sent_round = 0.0, -1

    def send_round(round_: int) -> None:
        targets = holders(me) if topology == "primary-backup" else holders(me)[:1]
        header = np.array([me, round_, 0], np.int64)
        for index in range(chunks):
            header[2] = index
            piece = memoryview(state)[index * chunk_bytes:(index + 1) * chunk_bytes]
            for target in targets:
                out[target].send_multipart([b"M", header.tobytes(), piece], copy=False)

    needed = COPIES if topology == "primary-backup" else 1  # acknowledgements a round waits for
    while True:
        if me in primaries and (sent_round == -1 or (sent_round < rounds and acks.get(sent_round, 0) == needed)):
            if sent_round >= spec["warmup"]:
                seconds.append(time.perf_counter() - started)
            sent_round += 1
            if sent_round == rounds:
                for target in out.values():
                    target.send_multipart([b"D", np.array([me, 0, 0], np.int64).tobytes(), b""])
                finished.add(me)
            else:
                started = time.perf_counter()
                send_round(sent_round)
        if finished >= set(primaries):
            break
        kind, raw, payload = inbox.recv_multipart(copy=False)
        primary, round_, index = (int(v) for v in np.frombuffer(raw.buffer, np.int64))
        if kind.bytes == b"D":
            finished.add(primary)
        elif kind.bytes == b"A":
            acks[round_] = acks.get(round_, 0) + 1
        else:
            copies[primary][index * chunk_bytes:(index + 1) * chunk_bytes] = np.frombuffer(payload.buffer, np.uint8)
            chain = holders(primary)
            if topology == "chain" and me == chain[0]:  # forward to the tail, chunk by chunk
                out[chain[1]].send_multipart([kind, raw, payload], copy=False)
            key = (primary, round_)
            filled[key] = filled.get(key, 0) + 1
            if filled[key] == chunks and (topology == "primary-backup" or me == chain[-1]):
                del filled[key]
                out[primary].send_multipart([b"A", raw.bytes, b""])
    for socket in (inbox, *out.values()):
        socket.close(linger=1000)
    context.term()
    return {"me": me, "seconds": seconds}


def run_case(bed: Netbed, topology: str, primaries: tuple[int, ...], args: argparse.Namespace) -> list[float]:
    """ms per round of every primary's timed rounds."""
    addresses = [bed.hosts[f"s{rank}"].address for rank in range(SERVERS)]
    start_at = time.time() + 1.2  # every process up by then (python, numpy, zmq: about half a second)
    processes = []
    for me in range(SERVERS):
        spec = {"me": me, "addresses": addresses, "topology": topology, "primaries": list(primaries),
                "state": args.state_mib * MIB, "chunk": args.chunk_kib << 10, "warmup": args.warmup,
                "rounds": args.rounds, "start_at": start_at}
        processes.append(bed.run(f"s{me}", [sys.executable, __file__, "--worker", json.dumps(spec)],
                                 stdout=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=args.timeout)
        if process.returncode != 0:
            raise SystemExit(f"a {topology} server failed (exit {process.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return [1000 * s for r in results for s in r["seconds"]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=8, metavar="MIB",
                        help="each server's state mirrored per round (default: %(default)s: Adam's value, m and v "
                             "of a 2.7 MiB shard)")
    parser.add_argument("--chunk-kib", type=int, default=512, metavar="KIB",
                        help="bytes per message (default: %(default)s, the transport's chunk)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="every link, both ways (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per run (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take (default: %(default)s)")
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    add_common_options(parser, "2 MiB, 1 warm-up + 9 rounds, 1 repeat", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.state_mib, args.warmup, args.rounds, args.repeats = 2, 1, 9, 1  # 3 rounds: a median off 1 run in 13
    if (args.state_mib * MIB) % (args.chunk_kib << 10):
        parser.error("--state-mib must be a whole number of --chunk-kib chunks")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(serve(json.loads(args.worker))), flush=True)
        return 0
    if not ready_for("mirror_topology"):
        return 0
    measured: dict[tuple[str, str], list[float]] = {}
    with Netbed() as bed:
        for rank in range(SERVERS):
            bed.host(f"s{rank}", args.rate_mbit)
        for repeat in range(args.repeats):
            for case, primaries in CASES.items():
                for topology in TOPOLOGIES if repeat % 2 == 0 else TOPOLOGIES[::-1]:  # alternate the order
                    ms = run_case(bed, topology, primaries, args)
                    measured.setdefault((case, topology), []).append(statistics.median(ms))
                    progress(f"  {case:12} {topology:15} repeat {repeat + 1}/{args.repeats}: "
                             f"{statistics.median(ms):.1f} ms a round")
    link_ms = args.state_mib * MIB * 8 / (args.rate_mbit * 1e6) * 1000
    rows, records = [], []
    for case in CASES:
        ours, peer = stats(measured[(case, "primary-backup")]), stats(measured[(case, "chain")])
        rows.append([case, ours.brief(1), peer.brief(1), f"{link_ms:.1f}", f"{peer.median / ours.median:.2f}x"])
        records.append(record(f"mirror-{case.replace(' ', '-')}", ours, peer, "chain replication", "ms/round",
                              better="lower", state_mib=args.state_mib, chunk_kib=args.chunk_kib, copies=COPIES,
                              servers=SERVERS, rate_mbit=args.rate_mbit, one_copy_on_the_link_ms=link_ms,
                              repeats=args.repeats, rounds=args.rounds))
    progress(f"\n{args.state_mib} MiB of state to {COPIES} holders a round, {SERVERS} hosts at {args.rate_mbit:g} "
             "Mbit/s; ms a round, median [min..max] of the repeats' medians")
    print_table(["case", "primary-backup", "chain", "1 copy on a link", "chain / primary-backup"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
