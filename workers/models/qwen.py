"""Qwen2, Qwen3 and Qwen3-MoE decoders: the Llama decoder with their differences.

Qwen2 adds biases on the q/k/v projections (ModelConfig.qkv_bias, set for this architecture).
Qwen3 drops those biases but normalizes every q and k head with an RMSNorm before rotary.
Qwen3-MoE is Qwen3 with sparse MoE MLPs on the layers its config names (the rest stay dense).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.workers.distributed.parallel import Parallel
from radixserve.workers.models.config import ModelConfig
from radixserve.workers.models.layers import RMSNorm
from radixserve.workers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from radixserve.workers.models.moe import SparseMoeBlock


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_id: int, backend, parallel: Parallel):
        super().__init__(config, layer_id, backend, parallel)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype)

    def prepare_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # One float32 normalization over all q|k heads, then each head's own weight.
        normed = torch.nn.functional.rms_norm(qk.float(), (self.head_dim,), None, self.q_norm.eps).to(
            qk.dtype
        )
        weight = torch.cat(
            (
                self.q_norm.weight.expand(self.num_heads, -1),
                self.k_norm.weight.expand(self.num_kv_heads, -1),
            )
        )
        return normed * weight


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    graph_capturable = False  # routing reads the expert counts back

    @staticmethod
    def make_mlp(config: ModelConfig, layer_id: int, parallel: Parallel) -> nn.Module:
        if config.moe is not None and layer_id in config.moe.layers:
            return SparseMoeBlock(config, parallel, weights_in_float32=False)
        return LlamaMLP(config, parallel)
