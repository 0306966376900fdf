"""Triton attention over the paged KV pool: compiled on a GPU, run by Triton's interpreter for CPU
tensors (TRITON_INTERPRET=1 before triton is first imported)."""

from .decode_attention import decode_attention
from .extend_attention import extend_attention

__all__ = ["decode_attention", "extend_attention"]
