"""The tensor-parallel engine offline: `Engine(tp_size=N)` runs rank 0 here (scheduler, radix
cache, sampler, grammars) and ranks 1..N-1 as local processes that follow its broadcasts. Greedy
output equals tp_size 1 (float32); the layout is checked at start-up; a rank that dies fails the
engine with an error that names it, and shutdown ends every rank."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from radixserve.workers import Engine
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.executor import tp_leader
from radixserve.workers.protocol import EngineError, GenerateRequest, SamplingParams
from tests.engine_utils import assert_kv_invariant, wait_idle
from tests.tiny_models import make_tiny_checkpoint

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    SYSTEM + "What is 2+2?",
    SYSTEM + "Name a colour.",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _abort_a_running_request(engine: Engine) -> tuple[str, int]:
    async def run():
        long = GenerateRequest(
            engine.tokenizer.encode("Tell me a long story."),
            SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True),
            stream=True,
        )
        stream = engine.submit(long)
        assert not (await stream.__anext__()).finished  # running
        assert engine.abort(long.rid)
        return [c async for c in stream][-1]

    last = asyncio.run(run())
    wait_idle(engine)
    return last.finish_reason["type"], last.completion_tokens


def scenario(engine: Engine) -> dict:
    """What the TP=3 and TP=1 engines must agree on: batched greedy output with a chunked prefill,
    a prompt the radix cache holds, a json_schema request, an abort; KV accounted for after each."""
    out: dict = {"batched": [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]}
    again = engine.generate(PROMPTS[3], GREEDY)
    out["again"] = again["output_ids"]
    out["cached"] = again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    assert_kv_invariant(engine)
    params = {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    constrained = engine.generate("Customer record for Ada, aged 36:", params)
    out["json"] = constrained["output_ids"]
    out["json_finish"] = constrained["meta_info"]["finish_reason"]["type"]
    if out["json_finish"] == "stop":
        assert set(json.loads(constrained["text"])) == {"name", "age"}
    assert_kv_invariant(engine)
    reason, tokens = _abort_a_running_request(engine)
    out["abort"] = reason
    assert tokens < 2000
    assert_kv_invariant(engine)
    return out


def test_default_model_tp3_equals_tp1_through_the_engine():
    """9 query / 3 KV heads: one KV head and three query heads per rank."""
    common = dict(dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    results = {}
    for tp in (1, 3):
        engine = Engine(tp_size=tp, num_threads=1 if tp > 1 else None, **common)
        try:
            assert engine.core.pool.k_buffers[0].shape[1] == (3 if tp == 1 else 1)
            results[tp] = scenario(engine)
            followers = engine.core.tp.handles
        finally:
            engine.shutdown()
        assert [h.exit_reason() for h in followers] == ["exited"] * (tp - 1)
    assert results[3] == results[1]
    assert results[1]["cached"] and results[1]["abort"] == "abort"


@pytest.fixture(scope="module")
def tiny_even(tmp_path_factory):
    # 4 query / 2 KV heads: one KV head per rank at TP=2.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("even"), "llama")


def _greedy(path, prompts, **kwargs) -> list[list[int]]:
    engine = Engine(str(path), dtype="float32", max_total_tokens=2048, num_threads=1, **kwargs)
    try:
        outs = [o["output_ids"] for o in engine.generate(prompts, {**GREEDY, "max_new_tokens": 12})]
        assert_kv_invariant(engine)
        return outs
    finally:
        engine.shutdown()


TINY_PROMPTS = ["Hello there", "A somewhat longer prompt, of more tokens than a chunk holds", "x"]


def test_tiny_tp2_equals_tp1(tiny_even):
    ref = _greedy(tiny_even, TINY_PROMPTS)
    assert _greedy(tiny_even, TINY_PROMPTS, tp_size=2, chunked_prefill_size=8) == ref
    # Overlap mode: the broadcasts and forwards run on the forward thread, keepalives between steps.
    assert _greedy(tiny_even, TINY_PROMPTS, tp_size=2, enable_overlap=True) == ref


def _prompt_logprobs(path, **kwargs) -> list[tuple[int, float | None, list]]:
    """(token, logprob, [(alternative, logprob)]) of every prompt token of a longer prompt."""
    engine = Engine(str(path), dtype="float32", max_total_tokens=2048, num_threads=1, **kwargs)
    try:
        params = {**GREEDY, "max_new_tokens": 2, "logprob_start_len": 0, "top_logprobs": 2}
        meta = engine.generate(TINY_PROMPTS[1], params)["meta_info"]
        assert_kv_invariant(engine)
    finally:
        engine.shutdown()
    return [
        (t, lp, [(a, v) for v, a, _ in top or []])
        for (lp, t, _), top in zip(meta["input_token_logprobs"], meta["input_top_logprobs"])
    ]


def test_tiny_tp2_prompt_logprobs_equal_tp1(tiny_even):
    """Every rank runs the forward with the extra logits rows (the header carries their count)."""
    ref = _prompt_logprobs(tiny_even)
    got = _prompt_logprobs(tiny_even, tp_size=2, chunked_prefill_size=8)
    assert [t for t, _, _ in got] == [t for t, _, _ in ref] and len(ref) > 8
    assert got[0][1] is None and ref[0][1] is None
    assert [lp for _, lp, _ in got[1:]] == pytest.approx([lp for _, lp, _ in ref[1:]], abs=1e-4)
    # A random model's alternatives may tie: their values agree, whichever id comes first.
    assert [len(top) for _, _, top in got] == [len(top) for _, _, top in ref]
    assert [v for _, _, top in got for _, v in top] == pytest.approx(
        [v for _, _, top in ref for _, v in top], abs=1e-4
    )


def test_tiny_moe_ep2_equals_ep1(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe", norm_topk_prob=True)
    ref = _greedy(path, TINY_PROMPTS)
    assert _greedy(path, TINY_PROMPTS, tp_size=2, ep_size=2) == ref


def test_layouts_that_do_not_exist_are_refused_at_start_up(tiny_even):
    with pytest.raises(ValueError, match="cannot split 9 query heads / 3 KV heads over 4 ranks"):
        Engine(tp_size=4)
    with pytest.raises(ValueError, match="ep_size 2 needs a mixture-of-experts model"):
        Engine(str(tiny_even), tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match=r"ep_size \(2\) must divide tp_size \(3\)"):
        EngineConfig(tp_size=3, ep_size=2)
    with pytest.raises(ValueError, match="tp_size and ep_size must be >= 1"):
        EngineConfig(tp_size=0)


def test_an_idle_group_outlives_its_collective_timeout(tiny_even, monkeypatch):
    """Rank 0 sends keepalives while idle: the followers' wait never reaches the timeout."""
    monkeypatch.setattr(tp_leader, "STEP_TIMEOUT_S", 6.0)
    monkeypatch.setattr(tp_leader, "KEEPALIVE_S", 0.5)
    engine = Engine(str(tiny_even), tp_size=2, dtype="float32", max_total_tokens=2048, num_threads=1)
    try:
        first = engine.generate("Hello there", GREEDY)["output_ids"]
        time.sleep(9.0)  # idle for longer than the timeout
        assert engine.core.tp.handles[0].exit_reason() is None
        assert engine.generate("Hello there", GREEDY)["output_ids"] == first
        engine.check_health()
    finally:
        engine.shutdown()


def test_a_follower_dying_fails_the_engine_with_its_name(tiny_even):
    engine = Engine(str(tiny_even), tp_size=2, dtype="float32", max_total_tokens=4096, num_threads=1)
    try:
        (follower,) = engine.core.tp.handles

        async def run():
            long = GenerateRequest(
                engine.tokenizer.encode("Tell me a long story."),
                SamplingParams(max_new_tokens=480, temperature=0, ignore_eos=True),
                stream=True,
            )
            stream = engine.submit(long)
            await stream.__anext__()
            follower.kill()  # SIGKILL, mid-generation
            with pytest.raises(EngineError) as err:
                async for _ in stream:
                    pass
            return str(err.value)

        message = asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert "tensor-parallel rank 1 of 2 was killed by signal 9" in message
        with pytest.raises(EngineError, match="rank 1 of 2 was killed by signal 9"):
            engine.check_health()
        with pytest.raises(EngineError, match="the engine has stopped"):
            engine.generate("Hello there", GREEDY)
        # The calls that wait for the engine thread's answer (the router's cache sync, a flush)
        # fail at once: a replica whose engine stopped drains without waiting them out.
        started = time.monotonic()
        for call in (engine.cache_summary, engine.flush_cache, engine.rank_transfers_open):
            with pytest.raises(EngineError, match="rank 1 of 2 was killed by signal 9"):
                call()
        assert time.monotonic() - started < 10
    finally:
        engine.shutdown()
    with pytest.raises(EngineError, match="rank 1 of 2 was killed"):
        engine.cache_summary()  # and after its shutdown
