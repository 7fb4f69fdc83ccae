"""Pure planners the workers of every framework share: balanced fusion groups and priority maps."""
