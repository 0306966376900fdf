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
