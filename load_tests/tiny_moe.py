"""A small random Qwen3-MoE checkpoint for the parallelism benchmarks (written once per run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def tiny_moe_checkpoint(
    out_dir: str | Path,
    hidden: int = 256,
    experts: int = 8,
    top_k: int = 2,
    width: int = 512,
    layers: int = 4,
) -> str:
    """Qwen3-MoE with `experts` experts of `width` intermediate features, `top_k` per token, and
    the default model's tokenizer (so the loader takes it like any checkpoint)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from radixserve.workers.models.loader import resolve_model_dir

    config = Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=2 * width,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir) / "tiny-moe"
    model.save_pretrained(str(out))
    source = resolve_model_dir(None)[0]
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return str(out)
