"""The hierarchy's three steps (worker/hierarchy.py) on 4 loopback workers, process sets standing in for 2 hosts.

On one machine the job has no hierarchy of its own (one host), so each worker builds one from the
sets a 2 x 2 job would have: "hosts" [0, 1] and [2, 3], local ranks across them [0, 2] and [1, 3].
Checked: sums of groups whose shares are empty on a local rank, uneven and large, by allreduce and
through a server; a host whose workers disagree on a group's layout fails that group on every worker
of the job, which then goes on in step. The multi-host runs are tests/integration/test_ssh_launch.py's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from testbed.cluster import LocalCluster

pytestmark = pytest.mark.slow

LENGTHS = (1, 3, 1000, 65537)


def hierarchy_cases(through_servers: bool) -> dict[str, Any]:
    import sluice.torch as hvd
    from sluice.worker.collective.process_set import sets_of
    from sluice.worker.hierarchy import Hierarchy, share_key
    from sluice.worker.torch.state import require

    hvd.init()
    node, rank = require(), hvd.rank()
    sets = sets_of(node)
    ids = [sets.add(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    tiers = Hierarchy(sets.engine(ids[rank // 2], "local"), sets.engine(ids[2 + rank % 2], "cross"), sets.job, 30.0)
    out: dict[str, Any] = {"shares": [tiers.share(n) for n in LENGTHS]}
    push_pull = node.ps.push_pull if through_servers else None
    if through_servers:
        shares = [(share_key(f"g{n}", tiers.local_rank), tiers.share(n)) for n in LENGTHS]
        node.ps.declare([(key, (end - start,), "float32", None) for key, (start, end) in shares if end > start],
                        tiers.cross_ranks)
    sums = []
    for n in LENGTHS:
        flat = node.ps.alloc((n,), "float32")
        flat[:] = np.arange(n, dtype=np.float32) * (rank + 1)
        tiers.allreduce(f"g{n}", flat, "float32", 0, ((n,),), push_pull).wait()
        sums.append(bool((flat == np.arange(n, dtype=np.float32) * 10).all()))
    out["sums"] = sums
    if not through_servers:  # rank 2 holds a (4, 2) where the others hold an (8,): host [2, 3] disagrees
        flat = node.ps.alloc((8,), "float32")
        try:
            tiers.allreduce("odd", flat, "float32", 0, ((4, 2),) if rank == 2 else ((8,),)).wait()
            out["odd"] = "no error"
        except Exception as exc:
            out["odd"] = f"{type(exc).__name__}: {exc}"
        after = node.ps.alloc((5,), "float32")
        after[:] = rank
        tiers.allreduce("after", after, "float32", 0).wait()
        out["after"] = after.tolist()
    tiers.close()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [0, 1])
def test_local_group_hierarchy_sums_every_share_and_a_hosts_disagreement_fails_every_worker(servers: int) -> None:
    with LocalCluster(4, servers, {"collective": {"stall_timeout": 20.0}}) as cluster:
        results = cluster.run(hierarchy_cases, servers == 1, timeout=100)
    for rank, out in enumerate(results):
        local_rank = rank % 2
        # 1 element: local rank 1's share is empty (it only gathers); 65537: the last share is one shorter
        assert [tuple(s) for s in out["shares"]] == [((0, 1), (1, 1))[local_rank], ((0, 2), (2, 3))[local_rank],
                                                      ((0, 500), (500, 1000))[local_rank],
                                                      ((0, 32769), (32769, 65537))[local_rank]], rank
        assert out["sums"] == [True] * len(LENGTHS), rank
        if servers == 0:
            odd = out["odd"]
            # host [2, 3] fails in its sum; host [0, 1] at the crossing, which the other host's workers refused
            assert odd.startswith("CollectiveError"), (rank, odd)
            if rank >= 2:
                assert "inside the host of workers [2, 3]" in odd and "'odd.local' mismatch" in odd, (rank, odd)
            else:
                assert "'odd.cross' mismatch" in odd and "refused the call (inside the host of workers [2, 3]" in odd
            assert out["after"] == [6.0] * 5, rank  # in step: the next group sums on every worker
