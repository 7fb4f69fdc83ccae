"""examples/digits.py reads scikit-learn's bundled digits as `load_digits()` gives them, without importing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"



def test_the_images_and_labels_are_scikit_learns() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    sys.path.append(str(EXAMPLES))  # as bench.common.import_example does (tests do not import the benchmarks)
    try:
        from digits import load_digits  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES))
    images, labels = load_digits()
    expected = datasets.load_digits()
    assert images.dtype == expected.images.dtype and labels.dtype == np.int64
    assert np.array_equal(images, expected.images) and np.array_equal(labels, expected.target)


def test_loading_them_does_not_import_scikit_learn() -> None:
    code = ("import sys; sys.path.append(sys.argv[1]); from digits import load_digits; images, labels = "
            "load_digits(); print(len(labels), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(EXAMPLES)], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert out == ["1797", "False"]
