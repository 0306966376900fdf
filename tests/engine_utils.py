"""Helpers for engine tests: the KV invariant, and the Hugging Face greedy reference."""

from __future__ import annotations

import time

import torch

from radixserve.workers.mem_cache.prefix_cache import kv_invariant_ok


def wait_idle(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.core.has_work():
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout}s: {engine.stats()}")
        time.sleep(0.01)


def assert_kv_invariant(engine) -> None:
    """At idle: free + evictable + protected == total, and no lock is held."""
    wait_idle(engine)
    core = engine.core
    core.cache.check_integrity()
    s = engine.stats()
    assert s["kv_free"] + s["kv_evictable"] + s["kv_protected"] == s["kv_total"], s
    assert s["kv_protected"] == 0, s
    assert kv_invariant_ok(core.pool, core.cache)
    assert core.req_pool.available() == core.req_pool.max_reqs
    assert s.get("lora_slots_held", 0) == 0, s


def hf_greedy(model_dir: str, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers in float32, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts_ids:
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


def tp_runs(path: str, tp_sizes=(1, 2), **kwargs) -> dict[int, list[dict]]:
    """Each tp_size's engine over `path` (kwargs: the engine's settings): a few prompts with their
    prompt logprobs and 6 greedy tokens each, the KV invariant checked after. For tests that a
    rank's KV pool (its dtype, its scales) works as rank 0's does."""
    from radixserve.workers import Engine

    prompts = [list(range(100, 140)), [7, 300, 42] * 9, [1, 5, 9, 200, 31]]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logprob_start_len": 0}
    out = {}
    for tp in tp_sizes:
        engine = Engine(path, tp_size=tp, max_total_tokens=2048, chunked_prefill_size=16, **kwargs)
        try:
            out[tp] = engine.generate(input_ids=prompts, sampling_params=params)
            assert_kv_invariant(engine)
        finally:
            engine.shutdown()
    return out


def mean_logprob_gap(a: list[dict], b: list[dict]) -> float:
    """Mean |difference| of two runs' prompt logprobs, over every prompt token but the first."""
    gaps = [
        abs(x - y)
        for ra, rb in zip(a, b)
        for (x, _, _), (y, _, _) in zip(
            ra["meta_info"]["input_token_logprobs"][1:], rb["meta_info"]["input_token_logprobs"][1:]
        )
    ]
    assert gaps
    return sum(gaps) / len(gaps)
