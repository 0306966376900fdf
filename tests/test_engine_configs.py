"""Greedy output must not depend on the radix cache, chunk size, page size, policy or memory pressure."""

import pytest

from radixserve.workers import Engine
from tests.engine_utils import assert_kv_invariant

SYSTEM = "You are a concise assistant. Answer in one short sentence. " * 6
QUESTIONS = [
    "What is the capital of Italy?",
    "Name a fruit.",
    "What is 3 times 3?",
    "Who wrote Hamlet?",
    "What colour is the sky?",
    "Say hello in French.",
]
PARAMS = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def run(**kwargs):
    engine = Engine(dtype="float32", **kwargs)
    try:
        first = engine.generate(SYSTEM + QUESTIONS[0], PARAMS)  # warms the shared prefix
        rest = engine.generate([SYSTEM + q for q in QUESTIONS[1:]], PARAMS)
        outs = [first] + rest
        stats = engine.stats()
        assert_kv_invariant(engine)
        return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], stats
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def baseline():
    return run(max_total_tokens=16384, disable_radix_cache=True, chunked_prefill_size=-1)


def test_radix_cache_reuses_prefix_with_identical_output(baseline):
    outs, cached, stats = run(max_total_tokens=16384, chunked_prefill_size=-1)
    assert outs == baseline[0]
    assert cached[0] == 0 and all(c >= 60 for c in cached[1:])
    assert baseline[1] == [0] * len(QUESTIONS)
    assert stats["computed_tokens_total"] < baseline[2]["computed_tokens_total"] / 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(chunked_prefill_size=16),
        dict(chunked_prefill_size=48, page_size=4),
        dict(chunked_prefill_size=32, schedule_policy="fcfs"),
        dict(chunked_prefill_size=64, schedule_policy="dfs-weight"),
        dict(chunked_prefill_size=64, schedule_policy="dfs-weight", disable_radix_cache=True),
    ],
    ids=["chunk16", "chunk48-page4", "fcfs", "dfs-weight", "dfs-weight-no-cache"],
)
def test_chunking_pages_and_policies_keep_output(baseline, kwargs):
    outs, _, _ = run(max_total_tokens=16384, **kwargs)
    assert outs == baseline[0]


def test_memory_pressure_finishes_everything_with_same_output(baseline):
    # Six sequences of ~110 tokens each in a pool of 256: far less than the total work.
    outs, _, stats = run(max_total_tokens=256, chunked_prefill_size=32)
    assert outs == baseline[0]
    assert stats["kv_total"] == 256


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_checkpoints_match_hf_through_the_engine(tmp_path, arch):
    from tests.engine_utils import hf_greedy
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, arch=arch)
    engine = Engine(path, dtype="float32", max_total_tokens=2048, chunked_prefill_size=8)
    try:
        prompts = [
            engine.tokenizer.encode(p)
            for p in ("Hello there, how are", "1 2 3 4 5 6 7 8 9", "Hello there, friend")
        ]
        expected = hf_greedy(path, prompts, 10)
        params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
        assert [
            engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts
        ] == expected
        engine.flush_cache()
        assert [
            o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)
        ] == expected
        assert_kv_invariant(engine)
    finally:
        engine.shutdown()
