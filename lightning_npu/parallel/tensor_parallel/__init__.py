"""Tensor parallelism on DTensor: styles, plans, how shards are held, vocab-parallel logits."""
