"""The Hugging Face transformers reference the model tests compare against."""

from __future__ import annotations

import torch


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' own forward with its KV cache, argmax each step, no EOS stop."""
    out = hf_model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf_model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


def default_model_dir() -> str:
    """The embedded default model's checkpoint directory (converted once, then cached)."""
    from radixserve.workers.models.loader import resolve_model_dir

    return str(resolve_model_dir(None)[0])
