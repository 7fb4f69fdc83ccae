"""Horovod's horovod.tensorflow.keras API on Sluice: `import sluice.tensorflow.keras as hvd` (sluice.worker.keras)."""

from sluice.tensorflow.keras import callbacks as callbacks
from sluice.tensorflow.keras import elastic as elastic
from sluice.worker.keras.tf_api import *  # noqa: F403
from sluice.worker.keras.tf_api import __all__ as _api_all

__all__ = sorted([*_api_all, "callbacks", "elastic"])
