"""GGUF -> Hugging Face directory (config.json, model.safetensors, tokenizer), once, atomically.

Quantized tensors are dequantized to float32 with the `gguf` package. llama.cpp stores the q/k
projections of llama-architecture models with rows permuted for its interleaved rotary; they are
permuted back to the Hugging Face (rotate-halves) layout here. The tokenizer and chat template are
rebuilt by transformers' GGUF reader. The result is written to a temporary directory next to the
target and renamed into place, so an interrupted or concurrent conversion never leaves a partial
directory behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONVERTER_VERSION = 1

# GGUF architecture -> (Hugging Face architecture, model_type, q/k rows permuted by llama.cpp)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def converted_dir(gguf_path: str | Path, cache_root: str | Path) -> Path:
    """Where the conversion of this file lives: keyed by its content, not its location."""
    path = Path(gguf_path)
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{path.stat().st_size}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(f.read())
    return Path(cache_root) / f"{path.stem}-{digest.hexdigest()[:12]}"


def ensure_converted(gguf_path: str | Path, cache_root: str | Path) -> Path:
    """Return the converted directory for `gguf_path`, converting it first if needed."""
    target = converted_dir(gguf_path, cache_root)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        # mkdtemp makes the directory private; a shared cache must be readable by everyone.
        os.chmod(tmp, 0o755)
        for child in tmp.iterdir():
            os.chmod(child, 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its directory is complete, ours is redundant.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    arch_key = meta.get("general.architecture")
    if arch_key not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch_key!r} is not supported; supported: {', '.join(_ARCHS)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with per-frequency rope factors (Llama 3.1 style) are not supported yet")
    config = _hf_config(meta, arch_key, tie=("output.weight" not in names))
    tensors = {}
    for t in reader.tensors:
        tensors[_hf_name(t.name)] = _dequantize(t, config, permuted=_ARCHS[arch_key][2])
    out = Path(out_dir)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _save_tokenizer(Path(gguf_path), out)


def _field_value(field) -> Any:
    try:
        return field.contents()
    except Exception:  # exotic field types we never read
        return None


def _hf_config(meta: dict[str, Any], arch_key: str, tie: bool) -> dict[str, Any]:
    def get(key, default=None):
        return meta.get(f"{arch_key}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = meta.get(f"{arch_key}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    architecture, model_type, _ = _ARCHS[arch_key]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tie,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
    return config


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or parts[2] not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"


def _dequantize(tensor, config: dict[str, Any], permuted: bool) -> torch.Tensor:
    from gguf import quants

    # GGUF lists dimensions fastest-first; numpy/torch want them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    array = quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
    result = torch.from_numpy(np.ascontiguousarray(array))
    if permuted and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        is_q = tensor.name.endswith("attn_q.weight")
        heads = config["num_attention_heads"] if is_q else config["num_key_value_heads"]
        result = unpermute_rotary_rows(result, heads)
    return result


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order (pairs interleaved) back to rotate-halves order.

    Within each head llama.cpp stores row (2*i + j) where Hugging Face has row (j*half + i).
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(str(out))
