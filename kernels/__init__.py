"""Hot ops: attention over the paged KV pool (reference and fast CPU backends)."""

from radixserve.kernels.attention import AttentionBackend, CpuBackend, TorchReferenceBackend, get_backend

__all__ = ["AttentionBackend", "CpuBackend", "TorchReferenceBackend", "get_backend"]
