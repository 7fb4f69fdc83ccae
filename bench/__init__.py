"""Benchmarks: each prints Sluice and a peer measured in the same run, and the ratio."""
