"""Worker functions for the collective tests: Horovod's API, join, stalls and mismatches, run in forked workers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tests.integration.training import digest, global_batches, make_model, make_optimizer


def horovod_api() -> dict[str, Any]:
    """Every collective of the API once, returning what a test compares with the expected values."""
    import sluice.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    base = torch.arange(10, dtype=torch.float32) + rank
    out["average"] = hvd.allreduce(base, name="avg").tolist()
    out["sum"] = hvd.allreduce(base, name="sum", op=hvd.Sum).tolist()
    out["average_flag"] = hvd.allreduce(base, average=False).tolist()  # unnamed: Horovod's deprecated flag
    in_place = base.clone()
    hvd.allreduce_(in_place, name="inplace", op=hvd.Sum)
    out["in_place"] = in_place.tolist()
    handle = hvd.allreduce_async(torch.full((3, 4), float(rank)), name="async", op=hvd.Sum)
    while not hvd.poll(handle):
        pass
    out["async"] = hvd.synchronize(handle).tolist()
    grouped = hvd.grouped_allreduce([torch.ones(2) * rank, torch.ones(3, 2) * (rank + 1)], name="grouped",
                                    op=hvd.Sum)
    out["grouped"] = [t.tolist() for t in grouped]
    for dtype in (torch.float16, torch.bfloat16):
        half = hvd.allreduce(torch.full((1000,), 0.5 + rank, dtype=dtype), name=f"half.{dtype}", op=hvd.Sum)
        out[f"half.{dtype}"] = (str(half.dtype), half.float().unique().tolist())
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="gather")
    out["allgather"] = gathered.tolist()
    out["broadcast"] = hvd.broadcast(torch.full((4,), float(rank)), root_rank=1, name="bcast").tolist()
    obj = {"rank": rank, "pair": (rank, "x"), "array": np.arange(3) * rank, "tensor": torch.ones(2) * rank}
    got = hvd.broadcast_object(obj, root_rank=1)
    out["broadcast_object"] = (got["rank"], got["pair"], got["array"].tolist(), got["tensor"].tolist())
    out["allgather_object"] = [o["pair"] for o in hvd.allgather_object(obj)]
    splits = [(rank + i) % 3 for i in range(size)]
    rows = torch.arange(sum(splits), dtype=torch.float32).unsqueeze(1) + 100 * rank
    received, counts = hvd.alltoall(rows, splits=splits, name="alltoall")
    out["alltoall"] = (received.squeeze(1).tolist(), counts.tolist())
    hvd.barrier()
    hvd.shutdown()
    return out


def train_uneven_then_join(steps: int) -> dict[str, Any]:
    """Rank r trains on `steps + r` batches, then joins; the others' allreduces go on with its zeros."""
    import sluice.torch as hvd

    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_optimizer(model, "sgd"), named_parameters=model.named_parameters())
    x, y = global_batches(steps + hvd.size(), 8)
    for step in range(steps + hvd.rank()):
        opt.zero_grad()
        F.mse_loss(model(x[step * 8: step * 8 + 8]), y[step * 8: step * 8 + 8]).backward()
        opt.step()
    hvd.synchronize_parameters()
    last = hvd.join()
    final = digest(model)
    hvd.shutdown()
    return {"last": last, "digest": final}


def stall(rank_that_skips: int) -> str:
    """Everyone but `rank_that_skips` allreduces 'lonely'; the error it gets (or 'no error')."""
    import sluice.torch as hvd

    hvd.init()
    try:
        if hvd.rank() != rank_that_skips:
            hvd.allreduce(torch.ones(3), name="lonely")
        else:
            hvd.allreduce(torch.ones(3), name="other")
    except Exception as exc:
        return str(exc)
    finally:
        hvd.shutdown()
    return "no error"


def mismatches() -> dict[str, Any]:
    """Rank 1 disagrees with the others on a shape, a dtype, an op and a broadcast root, each time
    followed by the same op agreed, then on one of four allreduces in flight at once: Horovod's
    semantics, each mismatch raises on every rank, the job goes on."""
    import sluice.torch as hvd

    hvd.init()
    odd = hvd.rank() == 1
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(5 if odd else 4), name="w"),
        "dtype": lambda: hvd.allreduce(torch.ones(4, dtype=torch.float64 if odd else torch.float32), name="w"),
        "op": lambda: hvd.allreduce(torch.ones(4), name="w", op=hvd.Sum if odd else hvd.Average),
        "root": lambda: hvd.broadcast(torch.ones(4), root_rank=2 if odd else 0, name="b"),
    }
    out: dict[str, Any] = {}
    for case, call in cases.items():
        try:
            call()
            out[case] = "no error"
        except Exception as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
        out[f"{case}.after"] = hvd.allreduce(torch.full((4,), hvd.rank() + 1.0), name="w", op=hvd.Sum).tolist()
    # several in flight at once, decided together (fused, under greedy fusion): only the odd one fails
    handles = [hvd.allreduce_async(torch.full((6 if odd and i == 2 else 4,), hvd.rank() + i), name=f"f{i}",
                                   op=hvd.Sum) for i in range(4)]
    for i, handle in enumerate(handles):
        try:
            out[f"fused.{i}"] = hvd.synchronize(handle).tolist()
        except Exception as exc:
            out[f"fused.{i}"] = f"{type(exc).__name__}: {exc}"
    hvd.shutdown()
    return out
