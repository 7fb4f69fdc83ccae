"""Sluice on Ray: the Ray Train backend (`TorchTrainer(fn, torch_config=SluiceConfig(servers=M))`) and Horovod's
RayExecutor (`from sluice.ray import RayExecutor`), both in sluice.launch.ray."""

from sluice.errors import MissingExtraError, require

require("ray", "ray", "sluice.ray (Sluice's Ray Train backend)")
try:
    from sluice.launch.ray.backend import SluiceBackend, SluiceConfig
    from sluice.launch.ray.executor import RayExecutor
    from sluice.launch.ray.executor import Worker as BaseHorovodWorker
except ImportError as missing:  # Ray without its Train extra (pyarrow, pandas, ...)
    raise MissingExtraError("ray", "ray[train]", f"sluice.ray (Sluice's Ray Train backend; {missing})") from missing

__all__ = ["BaseHorovodWorker", "RayExecutor", "SluiceBackend", "SluiceConfig"]


def __getattr__(name: str) -> object:
    if name == "ElasticRayExecutor":
        raise AttributeError("sluice.ray offers no ElasticRayExecutor: for elastic training on Ray use Ray Train's "
                             "TorchTrainer with SluiceConfig and FailureConfig(max_failures=N), or run the script "
                             "under `sluice launch --elastic`")
    raise AttributeError(f"module 'sluice.ray' has no attribute {name!r}")
