"""Where horovod.torch.sync_batch_norm's names are imported from: here, the whole of sluice.torch's API."""

from sluice.worker.torch.api import *  # noqa: F403
