"""GGUF -> Hugging Face directory (config.json, model.safetensors, tokenizer), once, atomically.

transformers' own GGUF reader does the translation: the config from the metadata, llama.cpp's
tensor names onto the Hugging Face model's, the dequantization (through the `gguf` package) and the
un-permutation of llama's q/k rows (llama.cpp interleaves the rotary halves). What is added here
is what that reader leaves out for the architectures served: the special token ids (it gives them
to the tokenizer only), Qwen3's head_dim (it maps `attention.key_length` only for Qwen3-MoE and
takes the config class's default otherwise), llama's linear rope scaling, and refusals for what would otherwise load silently wrong (per-frequency rope
factors, other scalings). The result is written to a temporary directory next to the target and
renamed into place, so an interrupted or concurrent conversion never leaves a partial directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

CONVERTER_VERSION = 2  # 2: transformers' GGUF reader (1: our own tables)

# GGUF architectures served (general.architecture); the model classes are transformers' choice.
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")


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
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    metadata, tensor_names = read_gguf_metadata(str(gguf_path))
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with per-frequency rope factors (Llama 3.1 style) are not supported yet")
    config_dict = load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"]
    config = AutoConfig.for_model(**{**config_dict, **_missing_config(metadata, arch)})
    with torch.device("meta"):  # only its parameter names are read
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {name: t.contiguous() for name, t in parsed["tensors"].items()}
    expected = {name for name, _ in skeleton.named_parameters()}
    if missing := sorted(expected - set(tensors)):
        raise ValueError(f"GGUF file lacks tensors for {missing[:4]}")
    out = Path(out_dir)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = torch.float32
    config.to_json_file(str(out / "config.json"))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _save_tokenizer(Path(gguf_path), out)


def _missing_config(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """Config fields the GGUF states but transformers' reader does not map for `arch`."""
    # The reader puts the special tokens into the tokenizer's config only; the model's defaults are
    # some other checkpoint's ids.
    extra: dict[str, Any] = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen3" and f"{arch}.attention.key_length" in metadata:
        extra["head_dim"] = int(metadata[f"{arch}.attention.key_length"])
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = float(metadata[f"{arch}.rope.scaling.factor"])
        extra["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    return extra


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(str(out))
