"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) over the paged KV pool.

Parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn...`) except the
fused projections: q/k/v become `qkv_proj` and gate/up become `gate_up_proj`; `load_weights` maps
checkpoint names onto them. `forward(batch, kv_pool)` returns float32 logits for the rows
`batch.logits_indices` only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_ops
from radixserve.workers.models.attention import AttentionBackend
from radixserve.workers.models.config import ModelConfig
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.models.layers import (
    FusedLinear,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    linear,
    silu_and_mul,
)

# checkpoint leaf module -> (our fused module, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = FusedLinear(c.hidden_size, [c.q_size, c.kv_size, c.kv_size], c.qkv_bias, c.dtype)
        self.o_proj = linear(c.q_size, c.hidden_size, c.o_bias, c.dtype)

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
    """silu(x @ gate^T) * (x @ up^T) @ down^T; also one expert of a sparse MoE block."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        c = config
        inter = intermediate_size or c.intermediate_size
        self.gate_up_proj = FusedLinear(c.hidden_size, [inter] * 2, c.mlp_bias, c.dtype)
        self.down_proj = linear(inter, c.hidden_size, c.mlp_bias, c.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend, attention_cls, mlp: nn.Module
    ):
        super().__init__()
        self.self_attn = attention_cls(config, layer_id, backend)
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
    def __init__(self, config: ModelConfig, backend: AttentionBackend, arch: type[LlamaForCausalLM]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, arch.attention_cls, arch.make_mlp(config, i))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)


class LlamaForCausalLM(nn.Module):
    """Build under `torch.device("meta")`, then `to_empty(device=...)` and `load_weights(...)`."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary_device="cpu"):
        super().__init__()
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend, type(self))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else linear(config.hidden_size, config.vocab_size, False, config.dtype)
        )
        # Explicit device: the table is computed now, even when the module is built on meta.
        self.rotary = RotaryEmbedding(
            config.head_dim, config.context_length, config.rope, config.dtype, rotary_device
        )

    @staticmethod
    def make_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
        """The MLP of decoder layer `layer_id` (MoE architectures pick sparse blocks here)."""
        return LlamaMLP(config)

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
        if self.lm_head is None:
            with torch.device("meta"):  # its own weight is replaced by the embedding's at once
                self.lm_head = linear(self.config.hidden_size, self.config.vocab_size, False, weight.dtype)
            self.lm_head.weight = weight  # type: ignore[assignment]  # a Parameter: nn.Embedding.weight
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_(crossover)
        return True

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool) -> torch.Tensor:
        self.backend.prepare(batch)
        cos, sin = self.rotary.cos_sin(batch.positions)
        layers = self.model.layers
        residual = self.model.embed_tokens(batch.input_ids)  # a fresh tensor: safe to update in place
        x = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            delta = layer(x, residual, cos, sin, batch, kv_pool)
            if i + 1 < len(layers):
                x = layers[i + 1].input_layernorm.add_forward(residual, delta)
        # Only the sampled rows go through the final add + norm and the LM head (the largest GEMM
        # of a small model): RMSNorm is per row, so this is exact.
        rows = batch.logits_indices
        h = self.model.norm.add_forward(residual[rows], delta[rows])
        logits = F.linear(h, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; raise if any parameter is left unset."""
        params = dict(self.named_parameters())
        expected = set(params)
        fused_loaded: set[tuple[str, int, str]] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            *path, leaf, kind = name.split(".")
            if leaf in _FUSED:
                fused, index = _FUSED[leaf]
                module_name = ".".join([*path, fused])
                self.get_submodule(module_name).load_shard(index, kind, tensor)
                fused_loaded.add((module_name, index, kind))
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}"
                )
            with torch.no_grad():
                params[name].copy_(tensor)
            expected.discard(name)
        for name in list(expected):
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, FusedLinear) and all(
                (module_name, i, kind) in fused_loaded for i in range(len(module.shard_sizes))
            ):
                expected.discard(name)
        if expected:
            raise ValueError(f"checkpoint is missing tensors: {sorted(expected)[:8]}")
