"""Sluice launcher: configuration, the `sluice` command and process supervision."""
