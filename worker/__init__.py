"""Sluice workers: the push/pull client and the framework shims."""
