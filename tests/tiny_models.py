"""Tiny random checkpoints for fast tests: Hugging Face layout, loadable by our loader and by
transformers' AutoModelForCausalLM alike.

    path = make_tiny_checkpoint(tmp_path, arch="qwen3", num_hidden_layers=3)

The weights come from transformers' own model classes (seeded), every 1-D parameter (norm weights,
biases) is randomized too so that loading them wrongly changes the output, and the tokenizer and
chat template are SmolLM2's (taken from the converted default model), so vocab_size is 49,152.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

_BASE: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# Llama 3.1-style frequency scaling with an original context short enough that a tiny model's
# rotary pairs fall in all three bands (kept, blended, stretched).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# Sparse MoE: 8 experts of width 32, two per token.
_MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}


def _config(arch: str, overrides: dict[str, Any]):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(classes)}")
    extra = {"head_dim": 32} if arch == "qwen3" else _MOE.get(arch, {})  # Qwen3: head_dim != hidden / heads
    return classes[arch](**{**_BASE, **extra, **overrides})


# A Qwen3-style chat template (SmolLM2's markers): the assistant's turn opens with an empty
# thinking block when the request's `enable_thinking` is false, and `system_note` (a template
# variable of its own) is written into a system turn.
QWEN3_CHAT_TEMPLATE = (
    "{%- if system_note is defined %}{{ '<|im_start|>system\\n' + system_note + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def smollm2_tokenizer_dir() -> Path:
    """The converted default model's directory (converting it on first use)."""
    from radixserve.workers.models.loader import resolve_model_dir

    return resolve_model_dir(None)[0]


def make_tiny_checkpoint(
    tmp_path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: str | None = None,
    chat_template: str | None = None,
    **overrides: Any,
) -> str:
    """Write a tiny random `arch` model ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
    "mixtral") under tmp_path.

    `overrides` are config fields (e.g. num_hidden_layers=3, tie_word_embeddings=True,
    rope_scaling=LLAMA3_ROPE_SCALING); `max_shard_size` (e.g. "1MB") shards the safetensors;
    `chat_template` replaces SmolLM2's (QWEN3_CHAT_TEMPLATE honours `enable_thinking`).
    Returns the checkpoint directory.
    """
    from transformers import AutoModelForCausalLM

    config = _config(arch, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                center = 1.0 if "norm" in name else 0.0
                param.normal_(center, 0.2)
    out = Path(tmp_path) / f"tiny-{arch}-{seed}"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    source = smollm2_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template)
    return str(out)


# Hugging Face module -> llama.cpp tensor name, written out here independently of the loader's
# own table so that a wrong mapping there cannot cancel out.
_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_BLOCK['.'.join(module)]}.{kind}"


def _llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of every head: HF row (j*half + i) -> (2*i + j).
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def random_blocks(type_name: str, rows: int, k: int, seed: int = 0):
    """Random raw blocks (numpy uint8 [rows, bytes]) of a GGML type whose float16 fields are small
    finite scales: what a quantizer the gguf package lacks (the K-quants) would write, values aside."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // per_block, nbytes), dtype=np.uint8)
    halves = rng.uniform(1e-3, 2e-2, size=(rows, k // per_block, 2)).astype(np.float16).view(np.uint8)
    fields = {"Q6_K": [208], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2]}.get(
        type_name, [0]
    )
    for i, at in enumerate(fields):
        raw[..., at : at + 2] = halves[..., 2 * i : 2 * i + 2]
    return raw.reshape(rows, -1)


def make_tiny_gguf(
    tmp_path: str | Path, hf_dir: str | Path, quant_types: dict[str, str] | None = None
) -> str:
    """Write the GGUF of a tiny llama/qwen2/qwen3 checkpoint, laid out as llama.cpp's converter
    does (q/k rows permuted for llama), with SmolLM2's GGUF tokenizer metadata. Tensors are float32
    except those `quant_types` names ({"attn_q": "Q4_K", "token_embd": "Q8_0", ...}): the gguf
    package quantizes the checkpoint's values where it can (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and the
    K-quants are random blocks (`random_blocks`)."""
    import json

    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    from radixserve.workers.models.loader import default_gguf_path

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = Path(tmp_path) / f"{Path(hf_dir).name}.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    source = gguf.GGUFReader(str(default_gguf_path()))
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    for name, tensor in load_file(str(Path(hf_dir) / "model.safetensors")).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _llama_cpp_permute(tensor, heads if "q_proj" in name else kv_heads)
        gguf_name = _gguf_name(name)
        kind = (quant_types or {}).get(gguf_name.split(".")[-2])
        values = tensor.float().contiguous().numpy()
        if kind is None:
            writer.add_tensor(gguf_name, values)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        if kind.endswith("_K"):
            raw = random_blocks(kind, values.shape[0], values.shape[1], seed=len(gguf_name))
        else:
            raw = quantize(values, qtype)
        writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)
