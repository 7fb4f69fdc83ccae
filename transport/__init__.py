"""Sluice transport: wire format, prioritized chunk queues and channels over ZeroMQ."""
