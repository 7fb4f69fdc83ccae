"""op=hvd.Adasum for TF tensors: every rank's tensor gathered, then combined by worker/collective/adasum.py.

As sluice.torch's Adasum: each tensor of a call travels as one row of an allgather (the first under
the call's name, alone; then the others at once: calls.in_step), so every rank holds every rank's
vector and combines them in rank order, by Horovod's tree of adjacent pairs, to the same result.
Prescale multiplies before, postscale after; there is no division by the size. float16, bfloat16
(combined in float32, rounded once), float32 and float64 only. Where the number of ranks is not a
power of two, an odd rank out is carried up a level (Horovod's CPU path refuses such a job).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from sluice.errors import InvalidCallError
from sluice.worker.collective.adasum import tree
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.reduce import bf16_to_f32, f32_to_bf16, scaled
from sluice.worker.tensorflow.calls import in_step

#: the wire dtypes Adasum combines
ADASUM_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_adasum(wires: Sequence[str], sparse: bool = False) -> None:
    """Horovod's refusals: floating tensors only, no tf.IndexedSlices."""
    if sparse:
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a "
                                  "workaround please pass sparse_as_dense=True to DistributedOptimizer")
    for wire in wires:
        if wire not in ADASUM_DTYPES:
            raise InvalidCallError(f"Adasum combines floating tensors (float16, bfloat16, float32, float64), "
                                   f"not {wire}")


def adasum_arrays(engine: CollectiveEngine, name: str, arrays: Sequence[np.ndarray], wires: Sequence[str],
                  prescale: float, postscale: float) -> list[np.ndarray]:
    """Each array combined over the ranks by Adasum, in fresh arrays of its shape and storage."""
    rows = [scaled(a, prescale, w).reshape(1, -1) if prescale != 1.0 else np.array(a).reshape(1, -1)
            for a, w in zip(arrays, wires, strict=True)]
    names = [name] + [f"{name}.{i}" for i in range(1, len(rows))]
    gathered = in_step([partial(engine.allgather, n, r, w) for n, r, w in zip(names, rows, wires, strict=True)])
    out = []
    for every, array, wire in zip(gathered, arrays, wires, strict=True):
        every = np.asarray(every)
        if wire == "bfloat16":  # in float32, rounded to bfloat16 once at the end
            combined = np.empty(every.shape[1], np.uint16)
            f32_to_bf16(tree([bf16_to_f32(v) for v in every]).copy(), combined)
        else:
            combined = tree(list(every))
        if postscale != 1.0:
            combined = scaled(combined, postscale, wire)
        out.append(combined.reshape(array.shape))
    return out
