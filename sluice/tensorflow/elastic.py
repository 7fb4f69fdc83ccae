"""Horovod's horovod.tensorflow.elastic on Sluice (implemented in sluice.worker.tensorflow.elastic)."""

from sluice.worker.tensorflow.elastic import *  # noqa: F403
from sluice.worker.tensorflow.elastic import __all__ as __all__
