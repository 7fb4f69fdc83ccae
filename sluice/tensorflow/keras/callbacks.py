"""Horovod's horovod.tensorflow.keras.callbacks on Sluice (implemented in sluice.worker.keras.callbacks)."""

from sluice.worker.keras.callbacks import *  # noqa: F403
from sluice.worker.keras.callbacks import __all__ as __all__
