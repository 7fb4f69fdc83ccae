"""The collective engine: the coordinator tree that orders operations and the allreduce family that runs them."""
