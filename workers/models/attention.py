"""Attention over the paged KV pool: the fast CPU backend, the GPU backends, and a reference.

- cpu: fused C++ kernels (kernels/cpu_ops); the default on CPU.
- triton: the Triton kernels of kernels/triton_ops, paged decode and extend over a cached prefix,
  reading K/V straight from the pool; the default on CUDA. On CPU tensors they run in Triton's
  interpreter (slow: for tests).
- torch: library kernels on any device: decode in two batched matmuls over gathered K/V, extend
  through flash-attn's varlen kernel where that package is installed (CUDA, fp16/bf16), else SDPA
  per sequence (kernels/varlen_attention.py).
- torch_ref: obviously-correct float32 math, one sequence at a time (tests).

Contract of `forward(q, k, v, layer_id, batch, kv_pool)`: q [T, H, D], k/v [T, KVH, D] for the T
new tokens of `batch`. The backend first writes k/v into `kv_pool.{k,v}_buffers[layer_id]` at
`batch.out_slots`, then lets each new token of sequence i attend to the sequence's cached prefix
and to the new tokens up to and including itself (causal, aligned to the end of the sequence).
Returns [T, H, D] in q's dtype. H must be a multiple of KVH (grouped-query attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops
from radixserve.kernels.varlen_attention import extend_attention_varlen
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.mem_cache.kv_pool import FP8, fp8_rows, raw
from radixserve.workers.models.forward_batch import ForwardBatch


class AttentionBackend:
    name = "base"

    def prepare(self, batch: ForwardBatch) -> None:
        """Called once per forward, before the first layer; caches masks in batch.attn_metadata."""

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, kv_pool) -> torch.Tensor:
        raise NotImplementedError


def store_kv(k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool) -> None:
    k_buf, v_buf = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
    if cpu_ops.store_kv_(k, v, k_buf, v_buf, batch.out_slots):
        return
    if k_buf.dtype == torch.int8:  # an int8 pool (KVPool): values and scales, as the kernel stores
        k, v = cpu_ops.kv_int8_rows(k), cpu_ops.kv_int8_rows(v)
    elif k_buf.dtype == FP8:
        k, v = fp8_rows(k, kv_pool.k_scales[layer_id]), fp8_rows(v, kv_pool.v_scales[layer_id])
    raw(k_buf).index_copy_(0, batch.out_slots, raw(k.to(k_buf.dtype)))
    raw(v_buf).index_copy_(0, batch.out_slots, raw(v.to(v_buf.dtype)))


def pool_values(buf: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The K or V rows of `slots` as float32 [len, heads, D]: an int8 pool's dequantized, an fp8
    pool's times its layer's `scale`."""
    rows = buf[slots]
    if buf.dtype == torch.int8:
        return cpu_ops.kv_int8_values(rows)
    return rows.float() * scale if buf.dtype == FP8 else rows.float()


class TorchReferenceBackend(AttentionBackend):
    """Obviously-correct float32 math, one sequence at a time. For tests, not for speed."""

    name = "torch_ref"

    def forward(self, q, k, v, layer_id, batch, kv_pool):
        store_kv(k, v, layer_id, batch, kv_pool)
        k_buf, v_buf = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
        group = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.empty_like(q)
        cu = batch.cu_extend
        for i, (seq_len, prefix) in enumerate(zip(batch.seq_lens_list, batch.prefix_lens_list)):
            slots = batch.kv_indices[i, :seq_len]
            keys = pool_values(k_buf, slots, kv_pool.k_scales[layer_id]).repeat_interleave(group, dim=1)
            values = pool_values(v_buf, slots, kv_pool.v_scales[layer_id]).repeat_interleave(group, dim=1)
            queries = q[cu[i] : cu[i + 1]].float()  # [E, H, D]
            scores = torch.einsum("ehd,lhd->hel", queries, keys) * scale
            query_pos = prefix + torch.arange(queries.shape[0], device=q.device).unsqueeze(1)
            key_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[cu[i] : cu[i + 1]] = torch.einsum("hel,lhd->ehd", probs, values).to(q.dtype)
        return out


@dataclass
class _ExtendSeq:
    start: int  # first row of this sequence's new tokens
    end: int
    slots: torch.Tensor | None  # KV slots of the whole sequence; None when there is no prefix
    mask: torch.Tensor | None  # [E, L] bool, True = attend; None = plain causal over new tokens


@dataclass
class _ExtendMeta:
    kv_indices: torch.Tensor  # contiguous int64 copies for the C++ kernel
    seq_lens: torch.Tensor
    cu_extend: torch.Tensor  # [B + 1]
    seqs: list[_ExtendSeq] | None = None  # built on first use by the SDPA fallback


class CpuBackend(AttentionBackend):
    """The fast CPU path: fused C++ kernels (kernels/cpu_ops) reading K/V straight from the pool.

    Decode: each sequence's K/V rows are read once for all query heads of their KV group, float32
    softmax and accumulation (torch's flash-attention CPU kernel is several times slower for one
    query per sequence). Extend: one call for the whole batch, flash-style blocks of 32 tokens over
    key blocks with causal block skipping; about 2x torch SDPA at 128-512 tokens.
    Without the extension: decode is one index_select per buffer and two batched matmuls, extend is
    SDPA per sequence (is_causal without a prefix, a bottom-right causal mask with one).

    batch_invariant (deterministic engines): a query's softmax runs over its keys in blocks of 32
    from position 0 whatever the batch, and decode runs extend's arithmetic, so a token's output
    is bitwise the same in any batch, chunk or phase: computed in a prefill chunk of any size
    beside a cached prefix, or decoded. Needs the extension (ValueError without it).
    """

    name = "cpu"

    def __init__(self, batch_invariant: bool = False) -> None:
        if batch_invariant and cpu_ops.native_ops() is None:
            raise ValueError("deterministic mode needs the CPU extension's attention kernels (none built)")
        self.batch_invariant = batch_invariant

    def prepare(self, batch: ForwardBatch) -> None:
        kv_indices, seq_lens = batch.kv_indices.contiguous(), batch.seq_lens.contiguous()
        if batch.kind is BatchKind.DECODE:
            batch.attn_metadata = (kv_indices, seq_lens)
        else:
            cu = torch.tensor(batch.cu_extend, dtype=torch.int64, device=kv_indices.device)
            batch.attn_metadata = _ExtendMeta(kv_indices, seq_lens, cu)

    def forward(self, q, k, v, layer_id, batch, kv_pool):
        store_kv(k, v, layer_id, batch, kv_pool)
        if batch.attn_metadata is None:
            self.prepare(batch)
        k_buf, v_buf = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
        qk = q if k_buf.dtype == torch.int8 else q.to(k_buf.dtype)  # an int8 pool takes bf16 q
        if batch.kind is BatchKind.DECODE:
            kv_indices, seq_lens = batch.attn_metadata
            out = cpu_ops.decode_attention(
                qk, k_buf, v_buf, kv_indices, seq_lens, fixed_order=self.batch_invariant
            )
            return out.to(q.dtype)
        meta = batch.attn_metadata
        out = cpu_ops.extend_attention_native(
            qk,
            k_buf,
            v_buf,
            meta.kv_indices,
            meta.seq_lens,
            meta.cu_extend,
            bf16_products=not self.batch_invariant,
        )
        if out is not None:
            return out.to(q.dtype)
        if self.batch_invariant:
            raise RuntimeError("batch-invariant extend attention needs float32 / bfloat16 CPU tensors")
        if meta.seqs is None:
            meta.seqs = _extend_seqs(batch)
        return _extend_sdpa(q, k, v, k_buf, v_buf, meta.seqs)


def _extend_seqs(batch: ForwardBatch) -> list[_ExtendSeq]:
    seqs = []
    cu = batch.cu_extend
    device = batch.kv_indices.device
    for i, (seq_len, prefix) in enumerate(zip(batch.seq_lens_list, batch.prefix_lens_list)):
        if prefix == 0:
            seqs.append(_ExtendSeq(cu[i], cu[i + 1], None, None))
            continue
        query_pos = prefix + torch.arange(seq_len - prefix, device=device).unsqueeze(1)
        mask = torch.arange(seq_len, device=device).unsqueeze(0) <= query_pos
        seqs.append(_ExtendSeq(cu[i], cu[i + 1], batch.kv_indices[i, :seq_len], mask))
    return seqs


def _extend_sdpa(q, k, v, k_buf, v_buf, seqs: list[_ExtendSeq]) -> torch.Tensor:
    out = torch.empty_like(q)
    for seq in seqs:
        queries = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, H, E, D]
        if seq.slots is None:
            keys = k[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            values = v[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        else:
            keys = pool_values(k_buf, seq.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            values = pool_values(v_buf, seq.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seq.mask, enable_gqa=True)
        out[seq.start : seq.end] = o.squeeze(0).transpose(0, 1)
    return out


class TorchBackend(AttentionBackend):
    """Library kernels on any device (see the module's docstring); no kernel of ours."""

    name = "torch"

    def forward(self, q, k, v, layer_id, batch, kv_pool):
        store_kv(k, v, layer_id, batch, kv_pool)
        k_buf, v_buf = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
        if batch.kind is BatchKind.DECODE:
            out = cpu_ops.decode_attention_torch(
                q.to(k_buf.dtype), k_buf, v_buf, batch.kv_indices, batch.seq_lens
            )
            return out.to(q.dtype)
        return extend_attention_varlen(
            q, k_buf, v_buf, batch.kv_indices, batch.seq_lens_list, batch.extend_lens_list
        )


class TritonBackend(AttentionBackend):
    """kernels/triton_ops over the pool: one launch (two for decode's split merge) per layer for
    the whole batch, no gather of K/V, nothing read back to the host (CUDA graphs can capture the
    decode forward). Needs a head_dim that is a power of two >= 16."""

    name = "triton"

    def __init__(self) -> None:
        from radixserve.kernels import triton_ops  # imports triton: only where this backend is used

        self.ops = triton_ops

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.kind is BatchKind.DECODE:
            batch.attn_metadata = None
        else:
            cu = torch.tensor(batch.cu_extend, dtype=torch.int64, device=batch.kv_indices.device)
            batch.attn_metadata = (cu, max(batch.extend_lens_list, default=0))

    def forward(self, q, k, v, layer_id, batch, kv_pool):
        store_kv(k, v, layer_id, batch, kv_pool)
        k_buf, v_buf = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
        # An fp8 pool's tiles are widened to q's dtype in the kernel, its scales applied there.
        scales = {"k_scale": kv_pool.k_scales[layer_id], "v_scale": kv_pool.v_scales[layer_id]}
        q_in = q if k_buf.dtype == FP8 else q.to(k_buf.dtype)
        if batch.kind is BatchKind.DECODE:
            out = self.ops.decode_attention(q_in, k_buf, v_buf, batch.kv_indices, batch.seq_lens, **scales)
            return out.to(q.dtype)
        if batch.attn_metadata is None:
            self.prepare(batch)
        cu, max_extend = batch.attn_metadata
        out = self.ops.extend_attention(
            q_in, k_buf, v_buf, batch.kv_indices, batch.seq_lens, cu, max_extend, **scales
        )
        return out.to(q.dtype)


_BACKENDS: dict[str, type[AttentionBackend]] = {
    "cpu": CpuBackend,
    "triton": TritonBackend,
    "torch": TorchBackend,
    "torch_ref": TorchReferenceBackend,
}
ATTENTION_BACKENDS = ("auto", *_BACKENDS)


def triton_fits(head_dim: int) -> bool:
    """Whether the Triton kernels take this head_dim (a power of two, at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def backend_name(name: str, device: str | torch.device, head_dim: int) -> str:
    """The backend `name` means on `device`: "auto" is cpu on CPU, triton on CUDA (torch where the
    head_dim does not suit the Triton kernels). Raises for unknown names and unsuitable choices."""
    kind = torch.device(device).type
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(ATTENTION_BACKENDS)}")
    if name == "auto":
        if kind == "cpu":
            return "cpu"
        return "triton" if triton_fits(head_dim) else "torch"
    if name == "cpu" and kind != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU only, not on {kind}")
    if name == "triton" and not triton_fits(head_dim):
        raise ValueError(f"the triton attention backend needs a power-of-two head_dim >= 16, not {head_dim}")
    return name


def get_backend(
    name: str = "auto", device: str | torch.device = "cpu", head_dim: int = 64, batch_invariant: bool = False
) -> AttentionBackend:
    """The attention backend `name` (see backend_name) for a model of `head_dim` on `device`.

    batch_invariant: the cpu backend's batch-invariant variant (CpuBackend), the only backend that
    has one; raises ValueError where `name` means another backend."""
    resolved = backend_name(name, device, head_dim)
    if not batch_invariant:
        return _BACKENDS[resolved]()
    if resolved != "cpu":
        raise ValueError(
            f"deterministic mode runs the cpu attention backend on CPU only, not {resolved!r} on "
            f"{torch.device(device).type}"
        )
    return CpuBackend(batch_invariant=True)
