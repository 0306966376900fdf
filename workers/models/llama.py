"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) over the paged KV pool.

Parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn...`) except the
fused projections: q/k/v become `qkv_proj` and gate/up become `gate_up_proj`; `load_weights` maps
checkpoint names onto them. `forward(batch, kv_pool)` returns float32 logits for the rows
`batch.logits_indices` only.

Under tensor parallelism (`parallel`, workers/distributed/parallel.py) the model is one rank's
shard: its own query and KV heads (`local_kv_heads` sizes its KV pool), a slice of every MLP, a
block of the vocabulary. Every rank runs the same forward on the same ForwardBatch; the forward
issues one all-reduce for the embedding, one per attention block and one per MLP block, and one
all-gather of the logits, so every rank returns the full logits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixserve.kernels import cpu_ops
from radixserve.workers.distributed.parallel import Parallel, shard_range
from radixserve.workers.models.attention import AttentionBackend
from radixserve.workers.models.config import ModelConfig
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.models.fused_decode import FusedDecode
from radixserve.workers.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from radixserve.workers.models.linear import FusedLinear, Linear
from radixserve.workers.models.parallel_layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from radixserve.workers.models.weight_loader import load_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend, parallel: Parallel):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.backend = backend
        split = parallel.heads(c.num_heads, c.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = split.num_heads, split.num_kv_heads, c.head_dim
        d = c.head_dim
        q, kv = (split.q_lo * d, split.q_hi * d), (split.kv_lo * d, split.kv_hi * d)
        self.qkv_proj = FusedLinear(c.hidden_size, [q, kv, kv], c.qkv_bias, c.dtype)
        self.o_proj = RowParallelLinear(q, c.hidden_size, c.o_bias, c.dtype, parallel.group)

    def forward(self, x: torch.Tensor, cos, sin, batch: ForwardBatch, kv_pool) -> torch.Tensor:
        tokens = x.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        heads = self.qkv_proj(x).view(tokens, qk_heads + self.num_kv_heads, self.head_dim)
        # q and k heads are adjacent, so one in-place rotary call covers both.
        qk = self.prepare_qk(heads[:, :qk_heads])
        RotaryEmbedding.apply_(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = heads[:, qk_heads:]
        out = self.backend.forward(q, k, v, self.layer_id, batch, kv_pool)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def prepare_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Hook before rotary on the [T, H + KVH, D] q|k heads (Qwen3 normalizes them here).

        May return its input (a view of the qkv output) since rotary then works in place.
        """
        return qk


class LlamaMLP(nn.Module):
    """silu(x @ gate^T) * (x @ up^T) @ down^T; also one expert of a sparse MoE block.

    A dense MLP splits its intermediate features over the tensor-parallel ranks and sums the
    partial outputs itself; an expert splits them over its expert group's ranks and leaves the
    sum to the MoE block (one all-reduce for all experts).
    """

    def __init__(self, config: ModelConfig, parallel: Parallel, expert_size: int | None = None):
        super().__init__()
        c = config
        if expert_size is None:
            inter, parts, part = c.intermediate_size, parallel.tp_size, parallel.tp_rank
        else:
            inter, parts, part = expert_size, parallel.config.moe_tp_size, parallel.moe_tp_rank
        rows = shard_range(inter, parts, part)
        self.gate_up_proj = FusedLinear(c.hidden_size, [rows, rows], c.mlp_bias, c.dtype)
        self.down_proj = RowParallelLinear(
            rows,
            c.hidden_size,
            c.mlp_bias,
            c.dtype,
            parallel.group,
            reduce=expert_size is None,
            holds_bias=part == 0,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend, parallel: Parallel, attention_cls, mlp):
        super().__init__()
        self.self_attn = attention_cls(config, layer_id, backend, parallel)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, cos, sin, batch: ForwardBatch, kv_pool
    ) -> torch.Tensor:
        """x = input_layernorm(residual); `residual` is updated in place. Returns the MLP output,
        which the next layer (or the final norm) adds to the residual."""
        x = self.self_attn(x, cos, sin, batch, kv_pool)
        x = self.post_attention_layernorm.add_forward(residual, x)
        return self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend, parallel: Parallel, arch: type[LlamaForCausalLM]):
        super().__init__()
        c = config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, c.dtype, parallel.group)
        self.layers: list[LlamaDecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            LlamaDecoderLayer(c, i, backend, parallel, arch.attention_cls, arch.make_mlp(c, i, parallel))
            for i in range(c.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)


class LlamaForCausalLM(nn.Module):
    """Build under `torch.device("meta")`, then `to_empty(device=...)` and `load_weights(...)`."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    # Whether the decode forward reads nothing back to the host, so that a CUDA graph can capture
    # it (MoE routing reads its expert counts: those models say no).
    graph_capturable = True

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary_device="cpu",
        parallel: Parallel | None = None,
    ):
        super().__init__()
        self.config = config
        self.backend = backend
        self.parallel = parallel = parallel or Parallel.single()
        self.local_kv_heads = parallel.heads(config.num_heads, config.num_kv_heads).num_kv_heads
        self.model = LlamaModel(config, backend, parallel, type(self))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, config.dtype, parallel.group, config.tie_word_embeddings
        )
        # Explicit device: the table is computed now, even when the module is built on meta.
        self.rotary = RotaryEmbedding(
            config.head_dim, config.context_length, config.rope, config.dtype, rotary_device
        )
        # Decode steps one native call per layer (fused_decode.py), where that runs the same
        # kernels: decided at the first forward, once LoRA has wrapped what it wraps.
        self.fused_decode: FusedDecode | None = None
        self._fused_checked = False

    @staticmethod
    def make_mlp(config: ModelConfig, layer_id: int, parallel: Parallel) -> nn.Module:
        """The MLP of decoder layer `layer_id` (MoE architectures pick sparse blocks here)."""
        return LlamaMLP(config, parallel)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name in this model's layout (architectures that name theirs
        differently translate here)."""
        return name

    def pack_weights(self, crossover: int | None = None) -> bool:
        """Give every projection its packed CPU GEMM copy where that kernel runs (after
        load_weights); `crossover` as in Linear.pack_. A tied LM head packs the embedding, and
        above the crossover multiplies by the embedding itself (no second plain copy).
        """
        weight = self.model.embed_tokens.weight
        if not cpu_ops.gemm_available(weight.dtype, weight.device):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_(crossover)
        return True

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool) -> torch.Tensor:
        self.backend.prepare(batch)
        cos, sin = self.rotary.cos_sin(batch.positions, max(batch.seq_lens_list, default=0) - 1)
        residual = self.model.embed_tokens(batch.input_ids)  # a fresh tensor: safe to update in place
        if not self._fused_checked:
            self.fused_decode, self._fused_checked = FusedDecode.build(self), True
        if self.fused_decode is not None and self.fused_decode.usable(batch, kv_pool):
            delta = self.fused_decode.run(residual, cos, sin, batch, kv_pool)
        else:
            delta = self._layers(residual, cos, sin, batch, kv_pool)
        # Only the sampled rows go through the final add + norm and the LM head (the largest GEMM
        # of a small model): RMSNorm is per row, so this is exact. (index_select: advanced
        # indexing costs ~10x more per call at decode sizes.)
        rows = batch.logits_indices
        h = self.model.norm.add_forward(residual.index_select(0, rows), delta.index_select(0, rows))
        return self.lm_head(h).float()

    def _layers(self, residual: torch.Tensor, cos, sin, batch: ForwardBatch, kv_pool) -> torch.Tensor:
        """Every decoder layer module in turn; returns the last one's MLP output."""
        layers = self.model.layers
        x = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            delta = layer(x, residual, cos, sin, batch, kv_pool)
            if batch.layer_done is not None:
                batch.layer_done(i)
            if i + 1 < len(layers):
                x = layers[i + 1].input_layernorm.add_forward(residual, delta)
        return delta

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's slice of every checkpoint tensor (Hugging Face names) in; raise if any
        parameter is left unset."""
        tied = self.config.tie_word_embeddings
        if tied:
            self.lm_head.tie_(self.model.embed_tokens)

        def skip(name: str) -> bool:
            return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")

        load_weights(self, weights, self.checkpoint_name, skip)
