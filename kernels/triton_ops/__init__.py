"""Triton attention over the paged KV pool: compiled for GPU tensors, run by Triton's interpreter
for CPU tensors (tests), in any process (common.py says how)."""

from .decode_attention import decode_attention
from .extend_attention import extend_attention

__all__ = ["decode_attention", "extend_attention"]
