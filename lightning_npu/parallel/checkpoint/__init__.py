"""Checkpoints: the one commit path, safe loading, sharded DCP directories, the single-file form, full state."""
