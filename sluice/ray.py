"""Sluice as a Ray Train backend: `TorchTrainer(fn, torch_config=SluiceConfig(servers=M))` (in sluice.launch.ray)."""

from sluice.errors import MissingExtraError, require

require("ray", "ray", "sluice.ray (Sluice's Ray Train backend)")
try:
    from sluice.launch.ray.backend import SluiceBackend, SluiceConfig
except ImportError as missing:  # Ray without its Train extra (pyarrow, pandas, ...)
    raise MissingExtraError("ray", "ray[train]", f"sluice.ray (Sluice's Ray Train backend; {missing})") from missing

__all__ = ["SluiceBackend", "SluiceConfig"]
