"""One drafter replica's training step and its checkpoints."""
