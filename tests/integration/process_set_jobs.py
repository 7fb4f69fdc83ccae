"""The worker function of the process-set conformance test (sluice.torch, 3 workers), written from Horovod's
test_torch.py *_process_sets tests and horovod/common/process_sets.py: static and dynamic sets, every
collective on a set (its results, its set-relative ranks, broadcast roots as global ranks), a set's
errors raising on its members only with the job staying in step, unnamed calls on a set not moving the
others' names, a DistributedOptimizer per set, and removal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _raised(call: Callable[[], Any]) -> str:
    import sluice.torch as hvd

    try:
        call()
    except hvd.HorovodInternalError as exc:
        return f"HorovodInternalError: {exc}"
    except ValueError as exc:
        return f"ValueError: {exc}"
    except TypeError as exc:
        return f"TypeError: {exc}"
    return "ok"


def _train(hvd: Any, process_set: Any, rank: int) -> list[float]:
    """Three SGD steps of a tiny linear model on this rank's batch, through a DistributedOptimizer of the set."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=process_set)
    for step in range(3):
        x = torch.full((2, 4), float(rank + step + 1))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    hvd.synchronize_parameters()  # step() returns at once: the updates finish before the next forward pass
    return [float(v) for v in torch.cat([p.detach().reshape(-1) for p in model.parameters()])]


def process_set_cases() -> dict[str, Any]:
    import sluice.torch as hvd

    static = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 1]), hvd.ProcessSet([1, 0])]  # the third: a duplicate
    hvd.init(process_sets=static)
    rank, out = hvd.rank(), {}
    first, second, clone = static
    out["static"] = [first.process_set_id, second.process_set_id, clone.process_set_id, second.ranks,
                     first.size(), first.rank(), first.included(), hvd.global_process_set.ranks]
    even = hvd.add_process_set([0, 2])
    odd = hvd.add_process_set(hvd.ProcessSet([1]))
    out["dynamic"] = [even.process_set_id, odd.process_set_id, even.rank(), odd.included()]
    out["duplicate"] = _raised(lambda: hvd.add_process_set([2, 0]))
    mine = even if rank in (0, 2) else odd
    value = torch.full((3,), float(rank + 1))
    out["sum"] = hvd.allreduce(value, op=hvd.Sum, process_set=mine).tolist()
    out["average"] = hvd.allreduce(value, process_set=mine).tolist()
    out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce([value, value * 2], op=hvd.Sum, process_set=mine)]
    out["allgather"] = hvd.allgather(torch.full((rank + 1, 1), rank), process_set=mine).reshape(-1).tolist()
    root = mine.ranks[-1]  # a global rank, as in Horovod
    out["broadcast"] = hvd.broadcast(torch.full((2,), float(rank)), root, process_set=mine).tolist()
    rows = torch.arange(mine.size() * 2, dtype=torch.float32) + 10 * rank
    out["alltoall"] = hvd.alltoall(rows, process_set=mine).tolist()
    out["reducescatter"] = hvd.reducescatter(torch.ones(4, 2) * (rank + 1), op=hvd.Sum, process_set=mine).tolist()
    hvd.barrier(mine)  # the set positional, as Horovod's barrier(process_set)
    out["object"] = hvd.broadcast_object({"from": rank}, root_rank=mine.ranks[-1], process_set=mine)
    # an object the codec cannot carry: TypeError on the root, the same call fails on the others, all go on
    out["object_refused"] = _raised(lambda: hvd.broadcast_object(object() if rank == 0 else None, root_rank=0))
    out["after_object"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist()
    leaf = torch.full((2,), float(rank + 1), requires_grad=True)
    (hvd.allreduce(leaf, op=hvd.Sum, process_set=mine) * (rank + 1)).sum().backward()
    out["grad"] = leaf.grad.tolist() if leaf.grad is not None else None
    # only the odd set's member calls unnamed collectives here: the job's names must not move
    if rank == 1:
        for _ in range(3):
            hvd.allreduce(torch.ones(1), process_set=odd)
    out["job_after_odd"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    # an error inside a set: its members raise (naming the set), the job goes on
    if rank in (0, 2):
        out["set_error"] = _raised(lambda: hvd.allreduce(torch.ones(2 + rank), process_set=even))
        out["after_set_error"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=even).tolist()
        out["bad_root"] = _raised(lambda: hvd.broadcast(torch.ones(1), 1, process_set=even))
    out["foreign"] = _raised(lambda: hvd.allreduce(torch.ones(1), process_set=odd if rank != 1 else even))
    # a set's op in flight while the job's runs
    handle = hvd.allreduce_async(torch.ones(4) * rank, op=hvd.Sum, process_set=mine)
    out["overlap_job"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist()
    out["overlap_set"] = hvd.synchronize(handle).tolist()
    out["trained"] = _train(hvd, even, rank)  # ranks 0 and 2: not adjacent, so the servers' sum skips rank 1
    from sluice.worker.torch.state import require  # which route the set's gradients took

    out["through_servers"] = require().ps.declared("set3.fusion.ps.float32.0")
    out["reference_alone"] = _local_reference(rank, [rank])
    out["reference_02"] = _local_reference(rank, [0, 2])
    out["removed"] = [hvd.remove_process_set(even), even.process_set_id, hvd.remove_process_set(even),
                      hvd.remove_process_set(hvd.global_process_set)]
    out["after_remove"] = _raised(lambda: hvd.allreduce(torch.ones(1), process_set=even))
    out["last"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist()
    return out


def _local_reference(rank: int, ranks: list[int]) -> list[float]:
    """The same three steps in one process, each gradient the average of `ranks`' batches' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        for r in ranks:
            (model(torch.full((2, 4), float(r + step + 1))).sum() / len(ranks)).backward()
        opt.step()
    return [float(v) for v in torch.cat([p.detach().reshape(-1) for p in model.parameters()])]
