"""Adasum's pairwise rule and its order over ranks (worker/collective/adasum.py), against the formula."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.worker.collective.adasum import pair, tree


def formula(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Maleki et al.'s A(a, b), in float64, as Horovod's test reference writes it (zero norms: coefficient 1)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot, aa, bb = a @ b, a @ a, b @ b
    return (1 - dot / (2 * aa) if aa else 1.0) * a + (1 - dot / (2 * bb) if bb else 1.0) * b


@pytest.mark.parametrize(("a", "b", "want"), [
    ([1.0, 0.0], [0.0, 1.0], [1.0, 1.0]),  # orthogonal: the sum
    ([1.0, 1.0], [2.0, 2.0], [1.5, 1.5]),  # parallel: the mean
    ([1.0, 2.0], [0.0, 0.0], [1.0, 2.0]),  # a zero vector adds nothing
    ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0]),
    ([3.0, 4.0], [3.0, 0.0], [3.96, 3.28]),  # 0.82 * a + 0.5 * b
    ([1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]),  # opposite: they cancel
])
def test_pair_table(a: list[float], b: list[float], want: list[float]) -> None:
    assert pair(np.array(a), np.array(b)).tolist() == pytest.approx(want, abs=1e-12)


def test_order_over_ranks_is_a_tree_of_adjacent_pairs_with_an_odd_one_carried_up() -> None:
    v = [np.random.default_rng(i).standard_normal(7) for i in range(5)]
    assert np.array_equal(tree(v[:1]), v[0])
    assert np.allclose(tree(v[:2]), formula(v[0], v[1]))
    assert np.allclose(tree(v[:3]), formula(formula(v[0], v[1]), v[2]))
    assert np.allclose(tree(v[:4]), formula(formula(v[0], v[1]), formula(v[2], v[3])))
    assert np.allclose(tree(v), formula(formula(formula(v[0], v[1]), formula(v[2], v[3])), v[4]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes_keep_theirs_with_float64_coefficients(dtype: type) -> None:
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(64).astype(dtype), rng.standard_normal(64).astype(dtype)
    got = pair(a, b)
    assert got.dtype == dtype
    assert np.allclose(got.astype(np.float64), formula(a, b), rtol=5e-3 if dtype == np.float16 else 1e-6, atol=5e-3)


def test_no_vectors_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        tree([])
