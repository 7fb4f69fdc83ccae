"""scikit-learn's 8x8 digits, read from the file its package ships: nothing is downloaded.

Read here rather than through `sklearn.datasets.load_digits`: importing scikit-learn (scipy and all) costs
every worker about 2 s of CPU for one small table, and the demo's four workers share two cores.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 images (float64, 8 x 8, values 0-16) and their labels (int64), as `load_digits()` gives them."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the digits data ships with scikit-learn: pip install scikit-learn "
                         "(or this project's `examples` extra)")
    table = np.loadtxt(os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz"),
                       delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
