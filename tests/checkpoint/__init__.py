"""Checkpoints: the model, resume, damage, elastic merges, compact state."""
