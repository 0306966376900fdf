"""A Llama-shaped decoder with random weights for kernel benchmarks: torch matmuls, the Triton
attention kernels over a paged KV pool, nothing of the engine. Its outputs mean nothing; its
traffic and arithmetic are those of the real model, and its FLOP and byte counts are exact.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Attention = Callable[[torch.Tensor, int], torch.Tensor]  # (q [T, H, D], layer) -> [T, H, D]


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_linear_params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.hidden * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """Untied embedding and LM head, two norms per layer and a final one."""
        per_layer = self.layer_linear_params + 2 * self.hidden
        return self.layers * per_layer + self.hidden + 2 * self.vocab * self.hidden

    def kv_bytes_per_token(self, elem: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * elem

    def decode_bytes(self, batch: int, context: int, elem: int = 2) -> int:
        """Bytes one decode step must move at least: every weight but the embedding table (one row
        per sequence), each sequence's KV of `context` tokens read plus its new token's written."""
        weights = (self.params - self.vocab * self.hidden) * elem + batch * self.hidden * elem
        return weights + batch * (context + 1) * self.kv_bytes_per_token(elem)

    def prefill_flops(self, batch: int, new_tokens: int, prefix: int = 0) -> int:
        """Matmul FLOPs of one prefill: projections of every new token, causal attention (QK and PV
        of each new token over the prefix and the new tokens up to itself), LM head of the last."""
        tokens = batch * new_tokens
        linear = 2 * self.layers * self.layer_linear_params * tokens
        keys_seen = batch * (new_tokens * prefix + new_tokens * (new_tokens + 1) // 2)
        attention = 4 * self.layers * self.heads * self.head_dim * keys_seen
        return linear + attention + 2 * self.hidden * self.vocab * batch


LLAMA3_8B = Shape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
TINY = Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512)


class RandomLlama:
    """Weights drawn on `device` directly (no host copy of an 8B model), scaled so activations
    stay finite through many layers. One KV pool of `num_slots` slots per layer."""

    def __init__(self, shape: Shape, num_slots: int, device: str, dtype=torch.bfloat16, seed: int = 0):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)
        s = shape

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=self.device, dtype=dtype)
            return w.mul_(1.0 / math.sqrt(cols))

        qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.embed = weight(s.vocab, s.hidden)
        self.layers = [
            {
                "wqkv": weight(qkv_rows, s.hidden),
                "wo": weight(s.hidden, s.hidden),
                "wgu": weight(2 * s.intermediate, s.hidden),
                "wdown": weight(s.hidden, s.intermediate),
                "ln1": torch.ones(s.hidden, device=self.device, dtype=dtype),
                "ln2": torch.ones(s.hidden, device=self.device, dtype=dtype),
            }
            for _ in range(s.layers)
        ]
        self.norm = torch.ones(s.hidden, device=self.device, dtype=dtype)
        self.lm_head = weight(s.vocab, s.hidden)
        pool_shape = (num_slots, s.kv_heads, s.head_dim)
        self.k_buffers = [
            torch.randn(pool_shape, generator=gen, device=self.device, dtype=dtype) for _ in range(s.layers)
        ]
        self.v_buffers = [
            torch.randn(pool_shape, generator=gen, device=self.device, dtype=dtype) for _ in range(s.layers)
        ]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.shape.head_dim // 2
        freqs = 500000.0 ** (-torch.arange(half, device=self.device, dtype=torch.float32) / half)
        angles = positions.float().unsqueeze(1) * freqs  # [T, D/2]
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        logits_rows: torch.Tensor,
        attention: Attention,
    ) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] in float32; stores the new tokens' K/V at out_slots."""
        s = self.shape
        h = self.embed[input_ids]
        tokens = input_ids.shape[0]
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, (s.hidden,), layer["ln1"], 1e-5)
            q, k, v = (x @ layer["wqkv"].T).split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(tokens, s.heads, s.head_dim), positions)
            k = self._rope(k.view(tokens, s.kv_heads, s.head_dim), positions)
            self.k_buffers[i].index_copy_(0, out_slots, k)
            self.v_buffers[i].index_copy_(0, out_slots, v.view(tokens, s.kv_heads, s.head_dim))
            h = h + attention(q, i).reshape(tokens, q_size) @ layer["wo"].T
            gate, up = (F.rms_norm(h, (s.hidden,), layer["ln2"], 1e-5) @ layer["wgu"].T).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ layer["wdown"].T
        last = F.rms_norm(h[logits_rows], (s.hidden,), self.norm, 1e-5)
        return (last @ self.lm_head.T).float()


@dataclass
class Layout:
    """Where a batch lives in the pool: sequence b's positions are at kv_indices[b, :seq_lens[b]]."""

    kv_indices: torch.Tensor  # [B, max_len] int64
    seq_lens: torch.Tensor  # [B] int64
    prefix: int
    new_tokens: int


def scattered_layout(
    batch: int, prefix: int, new_tokens: int, num_slots: int, device, seed: int = 0
) -> Layout:
    """Every sequence's slots drawn at random from the pool (as after many evictions), not one run."""
    length = prefix + new_tokens
    if batch * length > num_slots:
        raise ValueError(f"{batch} sequences of {length} tokens do not fit {num_slots} slots")
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[: batch * length].view(batch, length)
    seq_lens = torch.full((batch,), length, dtype=torch.int64)
    return Layout(slots.to(device), seq_lens.to(device), prefix, new_tokens)


def step_inputs(layout: Layout) -> dict[str, torch.Tensor]:
    """input_ids, positions, out_slots and logits_rows of the batch's new tokens."""
    batch = layout.kv_indices.shape[0]
    device = layout.kv_indices.device
    new = torch.arange(layout.prefix, layout.prefix + layout.new_tokens, device=device)
    return {
        "input_ids": torch.zeros(batch * layout.new_tokens, dtype=torch.int64, device=device),
        "positions": new.repeat(batch),
        "out_slots": layout.kv_indices[:, layout.prefix :].reshape(-1),
        "logits_rows": torch.arange(1, batch + 1, device=device) * layout.new_tokens - 1,
    }


def triton_attention(model: RandomLlama, layout: Layout) -> Attention:
    """Decode kernel for one new token per sequence, extend kernel otherwise."""
    from radixserve.kernels.triton_ops import decode_attention, extend_attention

    kv_indices, seq_lens = layout.kv_indices, layout.seq_lens
    if layout.new_tokens == 1:
        return lambda q, i: decode_attention(q, model.k_buffers[i], model.v_buffers[i], kv_indices, seq_lens)
    batch = kv_indices.shape[0]
    cu = torch.arange(batch + 1, device=kv_indices.device) * layout.new_tokens
    return lambda q, i: extend_attention(
        q, model.k_buffers[i], model.v_buffers[i], kv_indices, seq_lens, cu, layout.new_tokens
    )


def reference_attention(model: RandomLlama, layout: Layout) -> Attention:
    """Plain float32 torch over the same pool: the yardstick for `triton_attention`."""
    scale = 1.0 / math.sqrt(model.shape.head_dim)
    group = model.shape.heads // model.shape.kv_heads

    def attend(q: torch.Tensor, i: int) -> torch.Tensor:
        out = torch.empty_like(q)
        for b, slots in enumerate(layout.kv_indices):
            keys = model.k_buffers[i][slots].float().repeat_interleave(group, dim=1)
            values = model.v_buffers[i][slots].float().repeat_interleave(group, dim=1)
            rows = slice(b * layout.new_tokens, (b + 1) * layout.new_tokens)
            scores = torch.einsum("ehd,lhd->hel", q[rows].float(), keys) * scale
            query_pos = layout.prefix + torch.arange(layout.new_tokens, device=q.device).unsqueeze(1)
            visible = torch.arange(slots.shape[0], device=q.device).unsqueeze(0) <= query_pos
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[rows] = torch.einsum("hel,lhd->ehd", probs, values).to(q.dtype)
        return out

    return attend


def engine_model(
    shape: Shape, num_slots: int, device, dtype=torch.bfloat16, backend: str = "triton", seed: int = 0
):
    """The engine's own model (workers/models, Llama architecture) of `shape` with random weights
    drawn on `device`, and a KV pool of `num_slots` random slots: what `--device cuda` runs, without
    a checkpoint. Returns (model, pool)."""
    from radixserve.workers.mem_cache.kv_pool import KVPool
    from radixserve.workers.models.config import ModelConfig
    from radixserve.workers.models.loader import build_model

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
    }
    config = ModelConfig.from_hf(hf, dtype)
    model = build_model(config, backend, device)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # norm weights (no biases in Llama)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=gen)
    pool = KVPool(shape.layers, shape.kv_heads, shape.head_dim, num_slots, dtype=dtype, device=device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_(generator=gen)
    return model, pool


def engine_batch(layout: Layout):
    """The ForwardBatch of `layout`'s new tokens, as the engine's model runner builds it."""
    from radixserve.workers.batch_kind import BatchKind
    from radixserve.workers.models.forward_batch import ForwardBatch

    inputs = step_inputs(layout)
    batch = layout.kv_indices.shape[0]
    device = layout.kv_indices.device
    lengths = layout.seq_lens.tolist()
    return ForwardBatch(
        kind=BatchKind.DECODE if layout.new_tokens == 1 else BatchKind.PREFILL,
        input_ids=inputs["input_ids"],
        positions=inputs["positions"],
        out_slots=inputs["out_slots"],
        seq_lens=layout.seq_lens,
        extend_lens=torch.full((batch,), layout.new_tokens, dtype=torch.int64, device=device),
        kv_indices=layout.kv_indices,
        logits_indices=inputs["logits_rows"],
        seq_lens_list=lengths,
        extend_lens_list=[layout.new_tokens] * batch,
    )


@contextlib.contextmanager
def swapped_attention(model, backend) -> Iterator[None]:
    """The engine's `model` attends with `backend` for the duration (the model and each layer's
    attention hold their backend)."""
    holders = [model, *(layer.self_attn for layer in model.model.layers)]
    old = model.backend
    for holder in holders:
        holder.backend = backend
    try:
        yield
    finally:
        for holder in holders:
            holder.backend = old
