"""numpy storage type of each wire dtype; bfloat16 is kept as its raw 16-bit pattern, float8 as bytes."""

from __future__ import annotations

import numpy as np

STORAGE: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint64": np.uint64,
    "uint32": np.uint32,
    "uint16": np.uint16,
    "uint8": np.uint8,
    "bool": np.bool_,
    **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"), np.uint8),
}
#: dtypes whose values numpy can add (what servers sum): not bool, not the float8 formats kept as bytes
SUMMABLE = frozenset(("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint64",
                      "uint32", "uint16", "uint8"))
