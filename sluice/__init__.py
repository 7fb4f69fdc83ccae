"""Sluice: parameter-server and allreduce training with a priority network transport."""

__version__ = "0.1.0"
