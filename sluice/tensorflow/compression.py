"""Where horovod.tensorflow.compression's names are imported from: here, the whole of sluice.tensorflow's API."""

from sluice.worker.tensorflow.api import *  # noqa: F403
