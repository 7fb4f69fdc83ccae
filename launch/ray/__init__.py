"""Ray Train backend: a Sluice job's scheduler and servers for a Ray worker group, and its workers' set-up."""
