"""Horovod's Keras API on Sluice: `import sluice.keras as hvd` (implemented in sluice.worker.keras)."""

import sys

from sluice.worker.keras.api import *  # noqa: F403
from sluice.worker.keras.api import __all__ as __all__
from sluice.worker.keras.api import callbacks

# `from sluice.keras.callbacks import ...` works as `from horovod.keras.callbacks import ...` does
sys.modules[f"{__name__}.callbacks"] = callbacks
