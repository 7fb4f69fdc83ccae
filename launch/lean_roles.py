"""A Sluice role's process (scheduler, server, aggregator) keeps OpenBLAS to one thread; imported before numpy is.

numpy starts OpenBLAS's pool at import, a thread per core that spins before it sleeps: 0.2 CPU-s of a
0.54 CPU-s role start on a 2-core machine (`python -m sluice.launch.cli server --help`: 0.54 CPU-s,
0.35 with one thread). A role's sums and optimizers are elementwise, and its only BLAS calls are the
scheduler's tree planner's matrix-vector products (links by hosts; 0.24 ms on one thread for a thousand by
a thousand): the pool is pure cost, paid again at every restart and beside the workers on their hosts. Only the
roles: a worker's numpy is its user's, and the launcher's environment is the workers' (it sets
OMP_NUM_THREADS for them, as torchrun does). A value the user set is kept.
"""

from __future__ import annotations

import os
import sys

ROLES = ("scheduler", "server", "aggregator")

if sys.argv[1:2] and sys.argv[1] in ROLES:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
