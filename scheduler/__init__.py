"""Sluice scheduler: the scheduler process (rendezvous, partitioning, trees) and the control-plane client."""
