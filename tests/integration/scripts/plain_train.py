"""A worker with no framework, for tests of the launcher alone (a refused, lost or interrupted job): it joins
the job and push_pulls a small numpy array through the servers each step, checking the sum, and prints
`PLAIN_STEP N` every 10 steps. A torch worker starts at about 4 CPU-seconds (torch and its first
optimizer); this one at a tenth of it."""

import argparse
import time

import numpy as np

from sluice.worker.node import WorkerNode

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--pause", type=float, default=0.01, metavar="S", help="sleep this long after each step")
args = parser.parse_args()

node = WorkerNode()
client = node.ps
ones = client.alloc((1024,), "float32")
ones[:] = 1.0
total = np.empty(1024, np.float32)
client.declare([("plain", (1024,), "float32", None)])
for step in range(1, args.steps + 1):
    client.push_pull("plain", ones, total).wait()
    if not np.all(total == client.size):
        raise SystemExit(f"step {step}: the sum is not {client.size} everywhere")
    if step % 10 == 0:
        print(f"PLAIN_STEP {step}", flush=True)
    time.sleep(args.pause)
node.close()
print("PLAIN_DONE", flush=True)
