"""The worker function of the error conformance tests: each error of Horovod's torch API, then collectives that work.

The cases are written from Horovod's test_torch.py (test_horovod_*_error, *_type_error,
*_duplicate_name_error, alltoall's splits errors, reducescatter's scalar and op errors) and its
error paths (horovod/torch/mpi_ops.py, common/operations.cc, common/controller.cc): ranks that disagree
raise HorovodInternalError (a RuntimeError) on every rank; arguments no rank could run raise
ValueError. Here the ranks also disagree on whether a call is valid at all (one rank's bad splits or
wrong type): Sluice fails that call on every rank. After each case every rank runs an unnamed
allreduce (its name comes from the same sequence as the failed call's) and a named one, which must
both succeed: the ranks stayed in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _outcome(call: Callable[[], Any]) -> str:
    """'ok', or the most specific Horovod exception class the call raised."""
    return _raised(call)[0]


def _raised(call: Callable[[], Any]) -> tuple[str, str]:
    """('ok', ''), or (the most specific Horovod exception class the call raised, its message)."""
    import sluice.torch as hvd

    try:
        call()
    except hvd.HorovodInternalError as exc:
        return "HorovodInternalError", str(exc)
    except ValueError as exc:
        return "ValueError", str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", str(exc)
    return "ok", ""


def _cases(hvd: Any, rank: int, size: int) -> dict[str, Callable[[], Any]]:
    """Each case's call on this rank (Horovod's tests make most of them on every rank alike)."""
    ints, floats = torch.ones(17, dtype=torch.int32), torch.ones(17)
    return {
        "allreduce_shape": lambda: hvd.allreduce(torch.ones([17 + rank] * 3)),
        "allreduce_ndim": lambda: hvd.allreduce(torch.ones(17, 23 * 57) if rank == 0 else torch.ones(17, 23, 57)),
        "allreduce_dtype": lambda: hvd.allreduce(ints if rank % 2 == 0 else floats),
        "allreduce_op": lambda: hvd.allreduce(floats, op=hvd.Sum if rank == 0 else hvd.Average),
        "allreduce_prescale": lambda: hvd.allreduce(floats, prescale_factor=1.0 + rank),
        "allreduce_postscale": lambda: hvd.allreduce(floats, op=hvd.Sum, postscale_factor=1.0 + rank),
        "allreduce_same_name_again": lambda: hvd.allreduce(torch.ones(3 + rank), name="again"),
        "grouped_allreduce_shape": lambda: hvd.grouped_allreduce([floats, torch.ones(5 + rank)]),
        "allgather_shape": lambda: hvd.allgather(torch.ones(rank + 1, 10 * (rank + 1))),
        "allgather_dtype": lambda: hvd.allgather(ints if rank % 2 == 0 else floats),
        "broadcast_shape": lambda: hvd.broadcast(torch.ones(17 + rank), 0),
        "broadcast_dtype": lambda: hvd.broadcast(ints if rank % 2 == 0 else floats, 0),
        "broadcast_root_mismatch": lambda: hvd.broadcast(floats, rank),
        "broadcast_invalid_root": lambda: hvd.broadcast(floats, size),
        "alltoall_dtype": lambda: hvd.alltoall(torch.empty(size, dtype=torch.int32 if rank % 2 else torch.float32)),
        "alltoall_equal_split_length": lambda: hvd.alltoall(torch.empty(size + 1)),
        "alltoall_splits_sum": lambda: hvd.alltoall(torch.empty(size - 1), splits=torch.ones(size, dtype=torch.int32)),
        "alltoall_splits_type": lambda: hvd.alltoall(torch.empty(size), splits=torch.empty(size)),
        "alltoall_negative_splits": lambda: hvd.alltoall(torch.empty(size), splits=[2, -1] + [1] * (size - 2)),
        "alltoall_rank": lambda: hvd.alltoall(torch.ones(2 * size, 10 * (rank + 1))),
        "reducescatter_shape": lambda: hvd.reducescatter(torch.ones([17 + rank] * 3)),
        "reducescatter_dtype": lambda: hvd.reducescatter(torch.ones(6, dtype=torch.int32 if rank % 2 else torch.float)),
        "reducescatter_scalar": lambda: hvd.reducescatter(torch.tensor(float(rank))),
        "reducescatter_min": lambda: hvd.reducescatter(torch.ones(6), op=hvd.Min),
        # gradients of other shapes but the same size: their fused buffers have the same length
        "optimizer_shape": lambda: _optimizer_step(hvd, (3, 4) if rank % 2 == 0 else (4, 3)),
        # the ranks disagree on whether the call is valid: one refuses it, the others' same call fails too
        "one_rank_bad_splits": lambda: hvd.alltoall(torch.ones(size), splits=[size + 1] * size if rank == 0 else None),
        "one_rank_not_a_tensor": lambda: hvd.allreduce([1.0, 2.0] if rank == 0 else torch.ones(2)),
        "one_rank_bad_root": lambda: hvd.broadcast(floats, -1 if rank == 0 else 0),
    }


def _optimizer_step(hvd: Any, shape: tuple[int, int]) -> None:
    weight = torch.nn.Parameter(torch.ones(shape))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=0.1), named_parameters=[("w", weight)])
    weight.sum().backward()
    optimizer.synchronize()


def error_cases() -> dict[str, Any]:
    """Every case on every rank: what the call raised, the unnamed and named allreduce after it, the message."""
    import sluice.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for case, call in _cases(hvd, rank, size).items():
        raised, message = _raised(call)
        unnamed = hvd.allreduce(torch.full((3,), float(rank + 1)), op=hvd.Sum).tolist()
        named = hvd.allreduce(torch.ones(2), name="again" if case == "allreduce_same_name_again" else case,
                              op=hvd.Sum).tolist()
        out[case] = [raised, unnamed, named, message]
    out["duplicate_name"] = _duplicate_name(hvd, rank)
    hvd.shutdown()
    return out


def _duplicate_name(hvd: Any, rank: int) -> list[str]:
    """Horovod's test_horovod_allreduce_duplicate_name_error: a second op of a name whose first is in flight
    raises ValueError where it is made; both ops complete. Each rank tries while another has not submitted
    the first yet, so that it cannot have completed (the last rank to submit races the op's completion):
    the ranks but 0 under one name, rank 0 under another."""
    tensor, raised, results = torch.ones(17), [], []
    for name, tries in (("duplicate_name", rank > 0), ("duplicate_name.0", rank == 0)):
        if tries:
            first = hvd.allreduce_async(tensor, name=name)
            raised.append(_outcome(lambda: hvd.allreduce_async(tensor, name=name)))  # noqa: B023 (called at once)
        hvd.barrier()
        if not tries:
            first = hvd.allreduce_async(tensor, name=name)
        results.append(str(hvd.synchronize(first).tolist()[:2]))
    return raised + results


def join_cases() -> dict[str, Any]:
    """Horovod's test_horovod_join_allreduce, _allgather and _broadcast: each rank in turn joins at once;
    the others' allreduce sees its zeros (an average still divides by the size), their allgather and
    broadcast raise HorovodInternalError, then they join; every rank learns the same last joiner."""
    import sluice.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for first in range(size):
        if rank == first:
            last = hvd.join()
            out[f"first{first}"] = [last]
            continue
        averaged = hvd.allreduce(torch.full((4,), rank + 1.0), name=f"tensor_a.{first}").tolist()
        ints = hvd.allreduce(torch.full((4,), rank + 1, dtype=torch.int32), name=f"tensor_b.{first}").tolist()
        gathered = _outcome(lambda: hvd.allgather(torch.ones(2), name=f"gather.{first}"))  # noqa: B023
        broadcast = _outcome(lambda: hvd.broadcast(torch.ones(2), rank, name=f"bcast.{first}"))  # noqa: B023
        out[f"first{first}"] = [hvd.join(), averaged, ints, gathered, broadcast]
    out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


STEPS = {0: 5, 1: 3}  # worker 1 runs out of batches two steps early, then both run an epoch of 2 steps


def _join_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _join_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


def _grads(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    model.zero_grad()
    x, y = _join_data(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def uneven_epochs() -> dict[str, Any]:
    """Horovod's uneven-data idiom: train on what this rank has, hvd.join(), then the next epoch."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    model = _join_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = _join_data(rank)
    lasts = []
    for steps in (STEPS[rank], 2):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        hvd.synchronize_parameters()
        lasts.append(hvd.join())
    out = {"lasts": lasts, "params": [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]}
    hvd.shutdown()
    return out


def uneven_reference(optimizer_on: str) -> list[list[float]]:
    """Each rank's parameters after uneven_epochs, simulated in one process: a joined rank's gradient
    counts as zeros in the average over both; with the optimizer on the servers every rank that pushed
    gets the servers' values, on the workers each rank that stepped applies the average itself."""
    models = [_join_model(), _join_model()]
    server = _join_model()
    schedule = [(0, 1)] * 3 + [(0,)] * 2 + [(0, 1)] * 2  # who pushes at each round
    for pushing in schedule:
        grads = {r: _grads(models[r], r) for r in pushing}
        mean = [sum(grads[r][i] for r in pushing) / 2 for i in range(2)]
        with torch.no_grad():
            targets = [server] if optimizer_on == "server" else [models[r] for r in pushing]
            for target in targets:
                for p, g in zip(target.parameters(), mean, strict=True):
                    p -= 0.1 * g
            if optimizer_on == "server":
                for r in pushing:
                    models[r].load_state_dict(server.state_dict())
    return [[v for p in m.parameters() for v in p.detach().reshape(-1).tolist()] for m in models]
