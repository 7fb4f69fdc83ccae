"""The testbed that tests and benchmarks share: shaped network namespaces, forked clusters and ranks, helpers."""
