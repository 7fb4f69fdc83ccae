"""Horovod's elastic training, framework-free: commit files on each host (host.py) and the State protocol (state.py)."""
