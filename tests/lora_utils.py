"""Tiny PEFT LoRA adapters for tests, and the transformers reference with an adapter merged."""

from __future__ import annotations

import torch

from tests.hf_reference import default_model_dir, hf_greedy, load_hf

__all__ = ["ALL_TARGETS", "default_model_dir", "hf_greedy", "make_adapter", "merged_hf"]

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str,
    out_dir: str,
    seed: int,
    r: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    std: float = 0.02,
    **lora_kwargs,
) -> str:
    """A LoRA adapter of the checkpoint at `base_dir` with seeded random A and B (PEFT would start
    B at zero: the adapter would change nothing), saved as PEFT saves it; returns `out_dir`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets or ["q_proj", "v_proj"], lora_dropout=0.0, **lora_kwargs
    )
    model = get_peft_model(load_hf(base_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


def merged_hf(base_dir: str, adapter_dir: str | None):
    """transformers' model with the adapter merged into its weights (the base model for None)."""
    from peft import PeftModel

    hf = load_hf(base_dir)
    if adapter_dir is None:
        return hf
    return PeftModel.from_pretrained(hf, adapter_dir).merge_and_unload().eval()
