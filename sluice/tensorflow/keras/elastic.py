"""Horovod's horovod.tensorflow.keras.elastic on Sluice (implemented in sluice.worker.keras.elastic)."""

from sluice.worker.keras.elastic import *  # noqa: F403
from sluice.worker.keras.elastic import __all__ as __all__
