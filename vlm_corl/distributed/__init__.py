"""Running on several processes: the launch environment and placement of members on ranks (world),
the answer exchange, checkpoints."""
