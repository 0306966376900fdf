"""Our decoders against the Hugging Face transformers reference: greedy tokens must be equal in
float32 (one sequence, a batch of ragged sequences, and chunked prefill over a cached prefix)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.workers.models.config import RopeConfig
from radixserve.workers.models.layers import rope_inv_freq
from radixserve.workers.models.loader import load_model
from tests.hf_reference import hf_greedy, load_hf
from tests.model_driver import ModelDriver
from tests.tiny_models import LLAMA3_ROPE_SCALING, make_tiny_checkpoint

torch.set_num_threads(1)  # the machine is shared; one thread is the most predictable

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def default_fp32():
    return load_model(None, dtype="float32")


@pytest.fixture(scope="module")
def default_case(default_fp32):
    tok = default_fp32.tokenizer
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    hf = load_hf(default_fp32.model_path)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return prompts, refs, hf


def test_default_model_config(default_fp32):
    c = default_fp32.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
        64,
    )
    assert (c.vocab_size, c.tie_word_embeddings, c.eos_token_ids, c.bos_token_id) == (49152, True, (2,), 1)
    assert default_fp32.name == "SmolLM2-135M-Instruct"
    assert default_fp32.tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_default_model_greedy_equals_hf_one_sequence_at_a_time(default_fp32, default_case):
    prompts, refs, _ = default_case
    driver = ModelDriver(default_fp32.model, default_fp32.config)
    for prompt, ref in zip(prompts, refs):
        assert driver.greedy([prompt], NEW_TOKENS) == [ref]


def test_default_model_greedy_equals_hf_batched_and_chunked(default_fp32, default_case):
    prompts, refs, _ = default_case
    assert len({len(p) for p in prompts}) > 1  # ragged batch
    driver = ModelDriver(default_fp32.model, default_fp32.config)
    assert driver.greedy(prompts, NEW_TOKENS) == refs
    assert driver.greedy(prompts, NEW_TOKENS, chunk=min(map(len, prompts)) - 7) == refs  # two chunks each


def test_default_model_answers_sensibly(default_fp32, default_case):
    # Token equality with HF checks our model; this checks the GGUF conversion (e.g. the q/k
    # un-permutation), which HF, reading the same converted weights, could not catch.
    _, refs, _ = default_case
    assert default_fp32.tokenizer.decode(refs[0]).startswith("The capital of France is Paris")


def test_default_model_bf16_logits_close_to_hf_fp32(default_case):
    prompts, _, hf = default_case
    ours = load_model(None, dtype="bfloat16")
    assert ours.model.model.embed_tokens.weight.dtype == torch.bfloat16
    driver = ModelDriver(ours.model, ours.config)
    for prompt in prompts:
        logits = driver.logits_of(prompt)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        assert logits.dtype == torch.float32
        # The same top token, unless the reference's top two are within one bf16 step at their
        # magnitude (0.125 in [16, 32)): which bf16 GEMM the CPU has (AVX512-BF16, AMX, or torch's
        # conversion on AVX2) may then decide the tie either way.
        top = int(logits.argmax())
        assert top == int(ref.argmax()) or float(ref.max() - ref[top]) < 0.125, (top, int(ref.argmax()))
        p, q = torch.softmax(ref, -1), torch.softmax(logits, -1)
        assert 0.5 * (p - q).abs().sum() < 0.08  # total variation distance


TINY = {
    "llama": ("llama", {}),
    "llama3_rope_tied": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING, "tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "mixtral": ("mixtral", {}),
}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_model_greedy_equals_hf(tmp_path, name):
    arch, overrides = TINY[name]
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    ours = load_model(path, dtype="float32")
    hf = load_hf(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    refs = [hf_greedy(hf, p, 8) for p in prompts]
    driver = ModelDriver(ours.model, ours.config)
    assert [driver.greedy([p], 8)[0] for p in prompts] == refs
    assert driver.greedy(prompts, 8) == refs
    assert driver.greedy(prompts, 8, chunk=16) == refs


def test_torch_fallback_ops_give_the_same_greedy_tokens(tmp_path, monkeypatch):
    """Without the C++ extension (no compiler, or RADIXSERVE_CPU_KERNELS=0) every fused op runs
    its torch version; the model must still match the reference."""
    from radixserve.kernels import cpu_ops

    path = make_tiny_checkpoint(tmp_path, "qwen2")
    monkeypatch.setattr(cpu_ops, "native_ops", lambda: None)
    ours = load_model(path, dtype="float32")
    prompts = [list(range(100, 117)), list(range(200, 203))]
    refs = [hf_greedy(load_hf(path), p, 6) for p in prompts]
    assert ModelDriver(ours.model, ours.config).greedy(prompts, 6, chunk=8) == refs


def test_llama3_rope_scaling_bands():
    base = RopeConfig(theta=10000.0)
    scaled = RopeConfig(
        theta=10000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    plain, ours = rope_inv_freq(16, base), rope_inv_freq(16, scaled)
    wavelen = 2 * torch.pi / plain
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    middle = ~short & ~long
    assert short.any() and long.any() and middle.any()
    torch.testing.assert_close(ours[short], plain[short], atol=0, rtol=0)
    torch.testing.assert_close(ours[long], plain[long] / 8.0)
    assert ((ours[middle] < plain[middle]) & (ours[middle] > plain[middle] / 8.0)).all()


@pytest.mark.parametrize("crossover", ["none", "16"])  # packed at all sizes; prefill on torch
# q/k/v biases; a tied LM head; experts and a router of 8 outputs (half a packed strip)
@pytest.mark.parametrize("name", ["qwen2", "llama3_rope_tied", "qwen3_moe"])
def test_packed_bf16_projections_match_the_unpacked_model(tmp_path, monkeypatch, name, crossover):
    """bf16 models run their projections through the packed GEMM where the CPU has it; only the
    float32 summation order differs from torch's matmul, so the logits stay within bf16 noise."""
    from radixserve.kernels import cpu_ops
    from radixserve.kernels.gemm_crossover import ENV_OVERRIDE
    from radixserve.workers.models.linear import Linear
    from radixserve.workers.models.loader import build_model, iter_checkpoint

    arch, overrides = TINY[name]
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    monkeypatch.setenv(ENV_OVERRIDE, crossover)
    packed = load_model(path, dtype="bfloat16")
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert all(m.packed for m in linears) == cpu_ops.gemm_available(torch.bfloat16)
    if not cpu_ops.gemm_available(torch.bfloat16):
        pytest.skip("no AVX512-BF16 packed GEMM on this CPU")
    plain = build_model(packed.config)
    plain.load_weights(iter_checkpoint(Path(packed.model_path)))
    assert not any(m.packed for m in plain.modules() if isinstance(m, Linear))
    prompts = [list(range(100, 131)), list(range(300, 307))]
    a = ModelDriver(packed.model, packed.config).greedy(prompts, 8)
    b = ModelDriver(plain, packed.config).greedy(prompts, 8)
    assert a == b
    for p in prompts:
        la = ModelDriver(packed.model, packed.config).logits_of(p)
        lb = ModelDriver(plain, packed.config).logits_of(p)
        torch.testing.assert_close(la, lb, atol=0.05 * float(lb.abs().max()), rtol=0)
