"""Horovod's TensorFlow 2 API on Sluice: `import sluice.tensorflow as hvd` (implemented in sluice.worker.tensorflow)."""

from sluice.worker.tensorflow.api import *  # noqa: F403
from sluice.worker.tensorflow.api import __all__ as __all__
