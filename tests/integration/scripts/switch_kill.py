"""Rounds of exact sums through rotating aggregation trees, whose scheduler worker 0 kills in the middle of a switch.

Each worker pushes `rank + round` in every element of a tensor of many chunks behind a one-chunk
credit, so that pushes still wait in the send queues when new trees are announced; every round's sum
must be exactly sum(ranks) + size * round. With --kill-at-routes K, worker 0 SIGKILLs the job's
scheduler as a ROUTES reaches it, the K-th or the first after it that finds pushes of this worker still
queued (at most MORE_ROUTES later), before it takes the message in: the scheduler dies between ROUTES and
COMMIT, with this worker holding back the pushes of its round in flight, and the standby must finish
that switch. Each worker prints `SWITCH_RESULT {json}`.
"""

import argparse
import json
import sys

import numpy as np
from scheduler_kill import kill_scheduler  # beside this script

from sluice.transport.wire import Kind, Message
from sluice.worker.node import WorkerNode

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=60)
parser.add_argument("--elements", type=int, default=200_000, help="float32 elements of the tensor")
parser.add_argument("--kill-at-routes", type=int, default=-1, metavar="K",
                    help="worker 0 SIGKILLs the scheduler as the K-th ROUTES reaches it (-1: never)")
args = parser.parse_args()
#: ROUTES after the K-th that the kill waits at most for one that finds pushes queued
MORE_ROUTES = 20

node = WorkerNode()
client = node.ps
seen: list[int] = []
#: the pushes of rounds in flight this worker took back at the ROUTES the scheduler died after
held_at_kill: list[int] = []
if client.rank == 0 and args.kill_at_routes > 0:
    take_routes = node.control_routes[Kind.ROUTES]

    def queued_pushes() -> int:
        """This worker's pushes still in its send queues (counted, none taken: on the I/O thread, as ROUTES)."""
        count = 0

        def peek(peer: str, channel: int, msg: Message) -> bool:
            nonlocal count
            count += msg.kind == Kind.PUSH
            return False

        client.transport.withdraw(peek)
        return count

    def kill_then_take(msg: Message) -> None:
        seen.append(int((msg.meta or {})["routes"][0]))
        killing = not held_at_kill and len(seen) >= args.kill_at_routes and (
            queued_pushes() > 0 or len(seen) >= args.kill_at_routes + MORE_ROUTES)
        if killing:  # the scheduler waits for this worker's answer: it dies mid-switch
            kill_scheduler(len(seen))
            print(f"killed the scheduler at ROUTES of routing epoch {seen[-1]}", flush=True)
        take_routes(msg)
        if killing:
            held_at_kill.append(len(client._held_back.pushes))

    node.control_routes[Kind.ROUTES] = kill_then_take
client.declare([("grad", (args.elements,), "float32", None)])
wrong = []
try:
    for step in range(args.rounds):
        out = np.zeros(args.elements, np.float32)
        client.push_pull("grad", np.full(args.elements, client.rank + step, np.float32), out).wait()
        want = sum(range(client.size)) + client.size * step
        if not np.all(out == want):
            wrong.append([step, float(out.min()), float(out.max()), want])
    result = {"rank": client.rank, "rounds": args.rounds, "wrong": wrong, "epoch": client._router.epoch,
              "routes_seen": seen, "held_at_kill": held_at_kill}
finally:
    node.close()
print("SWITCH_RESULT " + json.dumps(result), flush=True)
sys.exit(1 if wrong else 0)
