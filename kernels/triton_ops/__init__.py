"""Triton attention over the paged KV pool: compiled for GPU tensors, run by Triton's interpreter
for CPU tensors (tests), in any process (common.py says how)."""

from .decode import decode_attention
from .extend import extend_attention

__all__ = ["decode_attention", "extend_attention"]
