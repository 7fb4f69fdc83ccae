"""PyTorch shim: Horovod's API (api.py) over the Sluice node, its collectives, optimizer and state."""
