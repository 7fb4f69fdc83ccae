"""op=hvd.Adasum on torch tensors: every rank's tensor gathered, then combined by worker/collective/adasum.py.

Each tensor (of a group: each on its own, as Horovod) travels as one row of an allgather, so every
rank holds every rank's vector and combines them in the same order to the same result; the ranks must
agree on the op like on any other (an Adasum against a Sum on another rank is a mismatch of kinds).
Prescale multiplies before, postscale after; there is no division by the size. bfloat16 is combined
in float32. An allgather moves size x the bytes of Horovod's vector halving: right for the gradients
of small and medium models on few ranks, which is where Adasum's convergence gains are reported.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sluice.errors import InvalidCallError
from sluice.worker.collective.adasum import tree
from sluice.worker.collective.reduce import scaled
from sluice.worker.staging import Staging, tensor_of, wire_dtype
from sluice.worker.torch.calls import AllOf, engine, register


def adasum_async_(call: str, tensors: Sequence[torch.Tensor], prescale: float, postscale: float) -> int:
    """Combine each of `tensors` over the ranks by Adasum, in place; an int handle (run the checks
    inside the caller's `refusing(call)`: `check_adasum` first)."""
    work = [t.detach().to(torch.float32) if t.dtype == torch.bfloat16 else t.detach() for t in tensors]
    work_dtype = work[0].dtype
    dtype = wire_dtype(work[0])
    rows = [Staging(t).load(t).copy().reshape(1, -1) for t in work]
    for row in rows:
        if prescale != 1.0:
            scaled(row, prescale, dtype, row)
    names = [call] if len(rows) == 1 else [f"{call}.{i}" for i in range(len(rows))]
    handles = [engine().allgather(name, row, dtype) for name, row in zip(names, rows, strict=True)]

    def finish() -> list[torch.Tensor]:
        for handle, tensor in zip(handles, tensors, strict=True):
            combined = tree(list(np.asarray(handle.result())))
            if postscale != 1.0:
                scaled(combined, postscale, dtype, combined)
            with torch.no_grad():
                tensor.copy_(tensor_of(combined, work_dtype).reshape(tensor.shape))
        return list(tensors)

    return register(AllOf(list(handles)), finish)


#: the torch dtypes Adasum combines (bfloat16 in float32)
_ADASUM_TORCH = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_adasum(tensors: Sequence[torch.Tensor]) -> None:
    """Horovod's Adasum takes floating tensors only."""
    for tensor in tensors:
        if tensor.dtype not in _ADASUM_TORCH:
            raise InvalidCallError(f"Adasum combines floating tensors (float16, bfloat16, float32, float64), "
                                   f"not {tensor.dtype}")
