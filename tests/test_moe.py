"""Sparse MoE models (Qwen3-MoE, Mixtral) from Hugging Face-layout checkpoints: routing, and greedy
output through the offline Engine equal to transformers' on the same tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from radixserve.workers import Engine
from radixserve.workers.models.mixtral import MixtralForCausalLM
from radixserve.workers.models.moe import route
from tests.engine_utils import assert_kv_invariant, hf_greedy
from tests.tiny_models import make_tiny_checkpoint

torch.set_num_threads(1)

NEW_TOKENS = 8


def test_route_takes_the_top_k_of_a_float32_softmax():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, top_k=2, renormalize=False)
    assert ids[0].tolist() == [1, 2] and weights.dtype == torch.float32
    torch.testing.assert_close(weights[0], probs[0, [1, 2]])
    weights, ids = route(logits.bfloat16(), top_k=2, renormalize=True)
    assert weights.dtype == torch.float32
    assert sorted(ids[1].tolist()) == [0, 3]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(weights[0], probs[0, [1, 2]] / probs[0, [1, 2]].sum(), atol=1e-2, rtol=1e-2)


def test_mixtral_checkpoint_names_map_onto_the_shared_moe_block():
    name = MixtralForCausalLM.checkpoint_name
    assert (
        name("model.layers.3.block_sparse_moe.experts.11.w1.weight")
        == "model.layers.3.mlp.experts.11.gate_proj.weight"
    )
    assert (
        name("model.layers.3.block_sparse_moe.experts.0.w3.weight")
        == "model.layers.3.mlp.experts.0.up_proj.weight"
    )
    assert (
        name("model.layers.0.block_sparse_moe.experts.7.w2.weight")
        == "model.layers.0.mlp.experts.7.down_proj.weight"
    )
    assert name("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


MOE_CASES = {
    # Qwen3-MoE as published: top-k weights renormalized.
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    # Raw softmax weights; layer 0 dense by mlp_only_layers, layer 2 dense by decoder_sparse_step.
    "qwen3_moe_mixed_layers": (
        "qwen3_moe",
        {"norm_topk_prob": False, "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2},
    ),
    "mixtral": ("mixtral", {}),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_greedy_through_the_engine_equals_transformers(tmp_path, case):
    arch, overrides = MOE_CASES[case]
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (6, 19, 33)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = Engine(path, dtype="float32", max_total_tokens=1024, chunked_prefill_size=16)
    try:
        config = engine.core.model_config
        assert config.moe is not None and config.moe.num_experts == 8
        if case == "qwen3_moe_mixed_layers":
            assert config.moe.layers == (1, 3)
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        alone = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        assert alone == expected
        engine.flush_cache()
        batched = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in batched] == expected
        assert_kv_invariant(engine)
    finally:
        engine.shutdown()
