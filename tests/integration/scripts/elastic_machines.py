"""A worker without a framework for an elastic range of machines (torchrun's --nnodes MIN:MAX), so that each start
of the job costs no torch import: `SIZE RESTART` in argv. In a job of SIZE ranks at TORCHELASTIC_RESTART_COUNT
RESTART it allreduces its rank and prints `RESULT rank size LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK sum restarts`;
in any other it prints `RUNNING rank size restarts pid` and allreduces until the job starts again (a machine
joined or was lost), for a minute at most (then exits 3)."""

import os
import sys
import time

import numpy as np

from sluice.worker.node import WorkerNode

size, restart = int(sys.argv[1]), sys.argv[2]
node = WorkerNode()
assert node.collectives is not None
restarts = os.environ["TORCHELASTIC_RESTART_COUNT"]
if str(node.rank) != os.environ["RANK"] or str(node.size) != os.environ["WORLD_SIZE"]:
    raise SystemExit(f"Sluice's rank {node.rank} of {node.size} is not torchrun's RANK {os.environ['RANK']} of "
                     f"WORLD_SIZE {os.environ['WORLD_SIZE']}")
if (node.size, restarts) != (size, restart):
    print("RUNNING", node.rank, node.size, restarts, os.getpid(), flush=True)
    for step in range(1200):
        node.collectives.allreduce(f"wait.{step}", [np.ones(1000, np.float32)], "float32", "sum").wait()
        time.sleep(0.05)
    sys.exit(3)
total = np.array([float(node.rank)], np.float32)
node.collectives.allreduce("rank", [total], "float32", "sum").wait()
node.close()
print("RESULT", node.rank, node.size, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"],
      os.environ["GROUP_RANK"], float(total[0]), restarts, flush=True)
