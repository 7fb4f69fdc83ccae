"""Sluice parameter servers: sharded storage, synchronous aggregation, server-side optimizers."""
