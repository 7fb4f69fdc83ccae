"""Pipeline stages between workers, framework-free: the layout of stages on ranks, stage messages, their exchange."""
