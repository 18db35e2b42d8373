"""What one rank does: its task (model and input), the training loop, collectives, checkpoints, metrics."""
