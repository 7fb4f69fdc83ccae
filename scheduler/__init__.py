"""Sluice scheduler: rendezvous, planners and the control plane."""
