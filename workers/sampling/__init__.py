"""Logits to tokens: the batched sampler and its top-k / top-p filters."""
