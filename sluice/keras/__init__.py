"""Horovod's horovod.keras API on Sluice: `import sluice.keras as hvd` (implemented in sluice.worker.keras).

A package, as horovod.keras is: `sluice.keras.callbacks` and `sluice.keras.elastic` are real submodules.
"""

from sluice.keras import callbacks as callbacks
from sluice.keras import elastic as elastic
from sluice.worker.keras.api import *  # noqa: F403
from sluice.worker.keras.api import __all__ as _api_all

__all__ = sorted([*_api_all, "callbacks", "elastic"])
