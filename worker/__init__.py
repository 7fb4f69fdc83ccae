"""Sluice workers: the worker node, the push/pull client, the collective engine, pipeline stages and framework shims."""
