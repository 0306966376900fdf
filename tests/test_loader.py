"""load_model: local paths only, sharded safetensors, GGUF conversion (layout, cache, atomicity),
dtype resolution and clear errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from radixserve.workers.models.loader import default_gguf_path, load_model, resolve_dtype, resolve_model_dir
from tests.model_driver import ModelDriver
from tests.tiny_models import make_tiny_checkpoint, make_tiny_gguf

torch.set_num_threads(1)

PROMPT = [17, 4000, 123, 9, 30000, 77, 5, 600]


def _logits(loaded) -> torch.Tensor:
    return ModelDriver(loaded.model, loaded.config, num_slots=64).logits_of(PROMPT)


def test_hub_id_fails_fast_without_contacting_a_hub():
    start = time.monotonic()
    with pytest.raises(
        FileNotFoundError, match="'meta-llama/Llama-3-8B' is not a local path.*never contacts a model hub"
    ):
        load_model("meta-llama/Llama-3-8B")
    assert time.monotonic() - start < 2.0


def test_bad_local_paths_give_clear_errors(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unknown_architecture_is_rejected(tmp_path):
    path = Path(make_tiny_checkpoint(tmp_path, "llama"))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        load_model(str(path))


def test_sharded_safetensors_load_equals_single_file(tmp_path):
    single = make_tiny_checkpoint(tmp_path / "single", "qwen2")
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", max_shard_size="1MB")
    index = json.loads((Path(sharded) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (Path(sharded) / "model.safetensors").exists()
    a, b = load_model(single, dtype="float32"), load_model(sharded, dtype="float32")
    assert b.name == "tiny-qwen2-0" and b.model_path == sharded
    torch.testing.assert_close(_logits(a), _logits(b), atol=0, rtol=0)


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    path = Path(make_tiny_checkpoint(tmp_path, "llama"))
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.mlp.gate_up_proj.weight'\]"):
        load_model(str(path))


# llama: q/k rows permuted by llama.cpp; qwen3: head_dim (32) != hidden / heads (16).
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_file_converts_once_and_matches_the_hf_checkpoint(tmp_path, monkeypatch, arch):
    hf_dir = make_tiny_checkpoint(tmp_path, arch, num_attention_heads=4, num_key_value_heads=2)
    gguf_file = make_tiny_gguf(tmp_path, hf_dir)
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))  # after the tokenizer was taken
    from_gguf = load_model(gguf_file, dtype="float32")
    converted = Path(from_gguf.model_path)
    assert converted.parent == tmp_path / "cache" / "models"
    assert from_gguf.name == f"tiny-{arch}-0"
    assert json.loads((converted / "config.json").read_text())["architectures"] == [
        json.loads((Path(hf_dir) / "config.json").read_text())["architectures"][0]
    ]
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]  # no temp dirs left
    # Permuted q/k rows, tensor names and metadata all have to be right for exact equality.
    torch.testing.assert_close(
        _logits(from_gguf), _logits(load_model(hf_dir, dtype="float32")), atol=1e-6, rtol=1e-6
    )
    assert from_gguf.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    ).endswith("<|im_start|>user\nhi<|im_end|>\n")
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert load_model(gguf_file, dtype="float32").model_path == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_gguf_conversion_equals_transformers_own_load_of_the_gguf(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_checkpoint(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2)
    gguf_file = Path(make_tiny_gguf(tmp_path, hf_dir))
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    ours = load_model(str(gguf_file), dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32, local_files_only=True
    ).eval()
    converted = load_file(str(Path(ours.model_path) / "model.safetensors"))
    state = reference.state_dict()
    assert set(converted) == set(state)
    for name, tensor in converted.items():
        assert torch.equal(tensor, state[name]), name
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(_logits(ours), expected, atol=1e-5, rtol=1e-5)


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(str(path))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_default_model_resolves_to_its_converted_gguf():
    directory, name = resolve_model_dir(None)
    assert name == "SmolLM2-135M-Instruct"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    assert resolve_model_dir(str(default_gguf_path()))[0] == directory  # keyed by content


def test_dtype_resolution():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("torch.bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype(None) is resolve_dtype("auto")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32
    if not torch.cuda.is_available():
        assert resolve_dtype(None) is expected
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")
