"""Horovod's TensorFlow 2 API on Sluice: `import sluice.tensorflow as hvd` (implemented in sluice.worker.tensorflow).

A package, as horovod.tensorflow is: `sluice.tensorflow.elastic`, `sluice.tensorflow.keras` and its
`callbacks` and `elastic` are real submodules, and names import from `mpi_ops`, `compression` and
`functions` (`from horovod.tensorflow.mpi_ops import Sum`), so every import path of Horovod's works, in
any order, and type checkers see them. Keras is imported only with sluice.tensorflow.keras.
"""

from sluice.tensorflow import compression as compression
from sluice.tensorflow import elastic as elastic
from sluice.tensorflow import functions as functions
from sluice.tensorflow import mpi_ops as mpi_ops
from sluice.worker.tensorflow.api import *  # noqa: F403
from sluice.worker.tensorflow.api import __all__ as _api_all

__all__ = sorted([*_api_all, "elastic"])


#: Horovod's names that are not API (internals it happens to import), and why Sluice leaves them out
NOT_OFFERED = {
    "LocalGradientAggregationHelper": "LocalGradientAggregationHelper is the internal helper of Horovod's "
    "DistributedOptimizer: pass backward_passes_per_step= to hvd.DistributedOptimizer instead",
    "device_compatibility_check": "device_compatibility_check is TensorFlow 2.2's module Horovod patched "
    "(tensorflow #38516); TensorFlow 2.21 needs no patch",
}


def __getattr__(name: str) -> object:
    """Horovod's non-API names fail saying so, and what to use instead."""
    if name in NOT_OFFERED:
        raise AttributeError(f"sluice.tensorflow.{name}: {NOT_OFFERED[name]}")
    raise AttributeError(f"module 'sluice.tensorflow' has no attribute {name!r}")
