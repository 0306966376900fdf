"""ModelConfig: the facts about a checkpoint that the model code and the engine need.

Built once from a Hugging Face `config.json` (both the transformers 4 layout with `rope_theta` /
`rope_scaling` and the transformers 5 layout with `rope_parameters`) plus `generation_config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)

# Rope types whose frequencies we compute ourselves; anything else fails at load time rather
# than producing silently wrong positions.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """Sparse MoE MLPs: softmax over the router logits, the top `top_k` experts, their weights
    renormalized to sum 1 when `norm_topk_prob` (Mixtral always; Qwen3-MoE per checkpoint)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool
    layers: tuple[int, ...]  # decoder layers whose MLP is sparse (the rest are dense)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], arch: str, num_layers: int) -> MoeConfig | None:
        if arch == "MixtralForCausalLM":
            experts = int(hf.get("num_local_experts", 8))
            return cls(
                experts,
                int(hf.get("num_experts_per_tok", 2)),
                int(hf["intermediate_size"]),
                True,
                tuple(range(num_layers)),
            )
        if arch != "Qwen3MoeForCausalLM":
            return None
        # transformers 5 writes `num_local_experts`, the published checkpoints `num_experts`.
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        step = int(hf.get("decoder_sparse_step", 1))
        dense = set(hf.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if experts and i not in dense and (i + 1) % step == 0)
        return cls(
            experts,
            int(hf.get("num_experts_per_tok", 8)),
            int(hf["moe_intermediate_size"]),
            bool(hf.get("norm_topk_prob", False)),
            layers,
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    context_length: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always, Llama when attention_bias)
    o_bias: bool  # bias on the output projection (Llama attention_bias only)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    moe: MoeConfig | None = None  # None: every layer has a dense MLP

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # Aliases under the Hugging Face names, for readers coming from there.
    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @classmethod
    def from_hf(
        cls,
        hf: dict[str, Any],
        dtype: torch.dtype,
        generation_config: dict[str, Any] | None = None,
    ) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {arch!r} (config.json 'architectures': {archs}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is implemented")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        num_layers = int(hf["num_hidden_layers"])
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(hf),
            context_length=_context_length(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if arch.startswith("Qwen") else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=_eos_ids(hf, generation_config or {}),
            bos_token_id=hf.get("bos_token_id"),
            dtype=dtype,
            moe=MoeConfig.from_hf(hf, arch, num_layers),
        )


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5 folds theta and scaling into rope_parameters; 4.x keeps them apart.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _context_length(hf: dict[str, Any]) -> int:
    length = int(hf.get("max_position_embeddings", 2048))
    # We attend over the full context; a model trained with a sliding window is exact only up
    # to that window, so the window caps the context we promise.
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", True):
        length = min(length, int(window))
    return length


def _eos_ids(hf: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (gen.get("eos_token_id"), hf.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
