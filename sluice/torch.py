"""Horovod's PyTorch API on Sluice: `import sluice.torch as hvd` (implemented in sluice.worker.torch)."""

from sluice.worker.torch.api import *  # noqa: F403
from sluice.worker.torch.api import __all__ as __all__
