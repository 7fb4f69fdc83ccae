"""numpy storage type of each wire dtype; bfloat16 is kept as its raw 16-bit pattern."""

from __future__ import annotations

import numpy as np

STORAGE: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "int64": np.int64,
    "int32": np.int32,
    "int8": np.int8,
    "uint8": np.uint8,
}
