"""Tensor and expert parallelism: N ranks as N local processes (Gloo), each building its shard of
the model and running the same forwards over its own KV pool; rank outputs against TP=1 and
transformers."""

from __future__ import annotations

import pytest
import torch

from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.distributed.launch import run_ranks
from radixserve.workers.distributed.parallel import (
    HeadSplit,
    Parallel,
    ParallelConfig,
    padded_range,
    shard_range,
)
from radixserve.workers.executor.tp_orders import SEND, CancelOrder, CountOrder
from radixserve.workers.models.loader import load_model
from tests.engine_utils import hf_greedy
from tests.model_driver import ModelDriver
from tests.tiny_models import make_tiny_checkpoint
from tests.tp_ranks import collectives_on_rank, greedy_on_rank, orders_on_rank, scheduled_greedy_on_rank

torch.set_num_threads(1)


def test_shard_and_padded_ranges():
    assert [shard_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(4, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [padded_range(49157, 2, i) for i in range(2)] == [(0, 24579, 24579), (24579, 49157, 24579)]
    assert [padded_range(7, 3, i) for i in range(3)] == [(0, 3, 3), (3, 6, 3), (6, 7, 3)]


def test_head_splits_keep_gqa_groups_whole():
    # The default model: 9 query heads, 3 KV heads.
    assert [HeadSplit.of(9, 3, 3, r) for r in range(3)] == [
        HeadSplit(0, 3, 0, 1),
        HeadSplit(3, 6, 1, 2),
        HeadSplit(6, 9, 2, 3),
    ]
    assert [HeadSplit.of(9, 3, 2, r) for r in range(2)] == [HeadSplit(0, 6, 0, 2), HeadSplit(6, 9, 2, 3)]
    # Fewer KV heads than ranks: each KV head replicated on two ranks that split its query heads.
    assert [HeadSplit.of(8, 2, 4, r) for r in range(4)] == [
        HeadSplit(0, 2, 0, 1),
        HeadSplit(2, 4, 0, 1),
        HeadSplit(4, 6, 1, 2),
        HeadSplit(6, 8, 1, 2),
    ]
    with pytest.raises(ValueError, match="cannot split 9 query heads / 3 KV heads over 4 ranks"):
        HeadSplit.of(9, 3, 4, 0)
    with pytest.raises(ValueError, match="cannot split 6 query heads / 2 KV heads over 4 ranks"):
        HeadSplit.of(6, 2, 4, 0)  # 3 query heads per KV head do not split over 2 replicas


def test_parallel_config_layout_and_validation():
    config = ParallelConfig(tp_size=4, ep_size=2)
    assert config.moe_tp_size == 2
    # Ranks 0-1 hold experts 0-3 (each rank half of every expert), ranks 2-3 experts 4-7.
    assert [config.ep_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [config.moe_tp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [config.experts(8, r) for r in range(4)] == [range(0, 4), range(0, 4), range(4, 8), range(4, 8)]
    assert [ParallelConfig(3, 3).experts(8, r) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 8)]
    with pytest.raises(ValueError, match="2 experts cannot be spread over ep_size 3"):
        ParallelConfig(3, 3).experts(2, 0)
    with pytest.raises(ValueError, match=r"ep_size \(3\) must divide tp_size \(4\)"):
        ParallelConfig(tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="the group has 1 ranks, the config tp_size 2"):
        Parallel(ParallelConfig(tp_size=2), CommGroup.single())
    single = Parallel.single()
    assert (single.tp_rank, single.ep_rank, single.moe_tp_rank, single.experts(8)) == (0, 0, 0, range(8))


def test_a_group_of_one_passes_everything_through():
    group = CommGroup.single()
    t = torch.arange(4.0)
    assert group.all_reduce(t) is t and group.all_gather(t) is t and group.broadcast(t) is t
    assert group.all_to_all(t, [4], [4]) is t and group.reduce_scatter(t) is t
    assert group.broadcast_object({"a": 1}) == {"a": 1}
    assert not group.stats.calls


def test_collectives_on_two_ranks():
    results = run_ranks(collectives_on_rank, 2)
    for r, out in enumerate(results):
        assert out["all_reduce"] == [3.0, 3.0, 3.0]
        assert out["all_gather"] == [[0.0, 1.0], [0.0, 1.0]]
        # sum over ranks of arange(4) * (rank + 1) = arange(4) * 3; rank r keeps rows 2r, 2r + 1
        assert out["reduce_scatter"] == [6.0 * r, 6.0 * r + 3.0]
        assert out["all_to_all"] == ([0.0, 10.0, 10.0] if r == 0 else [1.0, 1.0, 11.0, 11.0, 11.0])
        assert out["broadcast"] == [1.0, 1.0]
        assert out["object"] == {"step": 7, "ids": [1, 2]}
        assert out["stopped"]
        assert out["batch"] == {
            "input_ids": [5, 6, 7, 8],
            "positions": [2, 3, 4, 0],
            "out_slots": [3, 4, 5, 9],
            "seq_lens": [5, 1],
            "extend_lens": [3, 1],
            "kv_indices": [[1, 2, 3, 4, 5], [9, 0, 0, 0, 0]],
            "logits_indices": [2, 3],
            "kind": "prefill",
            "lists": ([5, 1], [3, 1]),
        }
    # broadcast_object and broadcast_batch are two broadcasts each, the stop one, plus the explicit one.
    assert results[0]["calls"] == {
        "all_reduce": 1,
        "all_gather": 1,
        "reduce_scatter": 1,
        "all_to_all": 1,
        "broadcast": 6,
    }


def test_orders_reach_the_followers_typed_and_an_unreadable_one_fails():
    results = run_ranks(orders_on_rank, 3)
    # (followers that failed the order, the sum of the others' answers)
    assert results[0]["answers"] == [(0, 23), (2, 0), (2, 0), (0, 23)]
    for r in (1, 2):
        assert results[r]["seen"] == [CountOrder(), CancelOrder(SEND, ("req-1",), "aborted"), CountOrder()]
        assert results[r]["stopped"]


def _tp1(path: str | None, prompts: list[list[int]], new_tokens: int, dtype: str = "float32") -> dict:
    loaded = load_model(path, dtype=dtype)
    driver = ModelDriver(loaded.model, loaded.config, num_slots=1024)
    return {
        "logits": driver.logits_of(prompts[0]),
        "tokens": driver.greedy(prompts, new_tokens),
        "params": sum(p.numel() for p in loaded.model.parameters()),
        "config": loaded.config,
    }


def _prompts(lengths, seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def _assert_ranks_equal_tp1(ranks: list[dict], ref: dict, tp: int) -> None:
    for out in ranks:
        assert out["tokens"] == ref["tokens"]
        assert out["chunked"] == ref["tokens"]
        # Only the order of the float32 sums differs (split GEMMs, all-reduce).
        torch.testing.assert_close(out["logits"], ref["logits"], atol=2e-4, rtol=1e-4)
    layers = ref["config"].num_layers
    # embedding + (attention + MLP) per layer; the logits once.
    assert ranks[0]["calls"] == {"all_reduce": 1 + 2 * layers, "all_gather": 1}


def test_default_model_tp3_equals_tp1():
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2], [1, 4093, 198, 504, 3575, 282, 4649, 314]]
    ref = _tp1(None, prompts, 4)
    ranks = run_ranks(greedy_on_rank, 3, None, 3, 1, prompts, 4)
    _assert_ranks_equal_tp1(ranks, ref, 3)
    assert [r["kv_heads"] for r in ranks] == [1, 1, 1]
    # Each rank holds a third of the weights (norm weights are replicated).
    assert all(r["params"] < ref["params"] / 3 + 40_000 for r in ranks)


@pytest.mark.parametrize(
    "name,overrides,kv_heads",
    [
        # Even heads (4 query / 2 KV): biases on q/k/v, o and the MLP; a tied LM head.
        ("even", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True), [1, 1]),
        # 6 query / 3 KV heads: 4 + 2 query heads; a vocabulary of 49,157 rows in 2 padded blocks.
        (
            "uneven",
            dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, vocab_size=49157),
            [2, 1],
        ),
    ],
)
def test_tiny_tp2_equals_tp1(tmp_path, name, overrides, kv_heads):
    path = make_tiny_checkpoint(tmp_path, "llama", **overrides)
    prompts = _prompts((5, 17, 9))
    ref = _tp1(path, prompts, 6)
    ranks = run_ranks(greedy_on_rank, 2, path, 2, 1, prompts, 6)
    _assert_ranks_equal_tp1(ranks, ref, 2)
    assert [r["kv_heads"] for r in ranks] == kv_heads


def test_a_scheduling_rank_drives_its_followers_by_broadcast(tmp_path):
    """Only rank 0 builds batches (chunked prefill, then decode); the others run whatever it
    broadcasts until it broadcasts the stop."""
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    prompts = _prompts((9, 20), seed=5)
    ref = _tp1(path, prompts, 5)
    assert run_ranks(scheduled_greedy_on_rank, 2, path, prompts, 5) == [ref["tokens"], None]


def test_tiny_tp2_bf16_logits_stay_within_bf16_noise_of_tp1(tmp_path):
    """bf16 shards (packed GEMMs where the CPU has them, bf16 all-reduces): the sums are rounded
    in a different order than at TP=1, so logits agree to bf16 precision, not bit for bit."""
    from radixserve.kernels import cpu_ops

    path = make_tiny_checkpoint(tmp_path, "qwen2")
    prompts = _prompts((12, 7))
    ref = _tp1(path, prompts, 4, dtype="bfloat16")
    ranks = run_ranks(greedy_on_rank, 2, path, 2, 1, prompts, 4, "bfloat16")
    for out in ranks:
        assert out["packed"] == cpu_ops.gemm_available(torch.bfloat16)
        scale = float(ref["logits"].abs().max())
        torch.testing.assert_close(out["logits"], ref["logits"], atol=0.05 * scale, rtol=0)
        assert int(out["logits"].argmax()) == int(ref["logits"].argmax())


MOE = {
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "mixtral": ("mixtral", {}),
}


@pytest.mark.parametrize(
    "arch,tp,ep",
    [
        ("qwen3_moe", 2, 1),  # every expert on both ranks, its intermediate features split
        ("qwen3_moe", 2, 2),  # 4 of the 8 experts on each rank
        ("mixtral", 2, 2),
        ("qwen3_moe", 4, 2),  # 2 expert groups of 2 ranks; 1 query head per rank
    ],
)
def test_moe_parallel_equals_ep1_and_transformers(tmp_path, arch, tp, ep):
    name, overrides = MOE[arch]
    path = make_tiny_checkpoint(tmp_path, name, **overrides)
    prompts = _prompts((6, 19, 11), seed=3)
    ref = _tp1(path, prompts, 6)
    assert ref["tokens"] == hf_greedy(path, prompts, 6)
    ranks = run_ranks(greedy_on_rank, tp, path, tp, ep, prompts, 6)
    _assert_ranks_equal_tp1(ranks, ref, tp)
