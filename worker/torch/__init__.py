"""PyTorch shim: Horovod's API (api.py) over the Sluice client, its collectives, optimizer and state."""
