"""Sluice as a Lightning strategy: `Trainer(strategy=SluiceStrategy())` (or "sluice") under `sluice launch`."""

from sluice.errors import require

require("lightning", "lightning", "sluice.lightning (Sluice's Lightning strategy)")

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402  # after the check that names the extra

from sluice.worker.lightning.strategy import SluiceEnvironment, SluiceStrategy  # noqa: E402

if SluiceStrategy.strategy_name not in StrategyRegistry:  # Trainer(strategy="sluice") once this is imported
    SluiceStrategy.register_strategies(StrategyRegistry)

__all__ = ["SluiceEnvironment", "SluiceStrategy"]
