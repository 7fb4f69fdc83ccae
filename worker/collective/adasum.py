"""Adasum, Horovod's adaptive summation (pure numpy): pairs of vectors combined by how much they agree.

For two vectors a and b (Maleki et al., "Scaling Distributed Training with Adaptive Summation",
MLSys'21; horovod/common/ops/adasum/adasum.h):

    A(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with the dot product and squared norms in float64, and a coefficient of 1 for a vector whose squared
norm is below sqrt(DBL_MIN) (a zero vector adds nothing). Parallel vectors give their mean,
orthogonal ones their sum. Ranks combine as Horovod's recursive vector halving does, which is a
binary tree over adjacent ranks: A(A(r0, r1), A(r2, r3)), ... For a number of ranks that is not a
power of two Horovod's CPU path refuses and its core drops the ranks past the largest power of two;
here the last rank of an odd level is carried up unchanged to the next (3 ranks: A(A(r0, r1), r2)),
so every rank's vector counts. Each tensor of a group is combined on its own.
"""

from __future__ import annotations

import numpy as np

#: sqrt(DBL_MIN): below it a squared norm counts as zero (Horovod's guard)
_TINY = float(np.sqrt(np.finfo(np.float64).tiny))


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A(a, b): the coefficients from float64 sums, the combination in a's dtype (float16 in float32)."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot, a_sq, b_sq = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    a_coeff = 1.0 - dot / (2.0 * a_sq) if a_sq >= _TINY else 1.0
    b_coeff = 1.0 - dot / (2.0 * b_sq) if b_sq >= _TINY else 1.0
    work = np.float32 if a.dtype == np.float16 else a.dtype.type
    combined = work(a_coeff) * a.astype(work) + work(b_coeff) * b.astype(work)
    return combined.astype(a.dtype)


def tree(vectors: list[np.ndarray]) -> np.ndarray:
    """Every rank's vector (in rank order) combined pairwise, level by level: adjacent pairs first,
    an unpaired last one carried up."""
    if not vectors:
        raise ValueError("Adasum needs at least one vector")
    level = list(vectors)
    while len(level) > 1:
        combined = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = combined + ([level[-1]] if len(level) % 2 else [])
    return level[0]
