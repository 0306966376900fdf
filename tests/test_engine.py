"""The engine end to end on the default model (SmolLM2-135M-Instruct), float32 for exact greedy
equality with the Hugging Face reference."""

import asyncio
import dataclasses
import time

import pytest

from radixserve.workers import Engine
from radixserve.workers.protocol import (
    GenerateRequest,
    InvalidRequest,
    QueueFull,
    SamplingParams,
    attempt_rid,
)
from tests.engine_utils import assert_kv_invariant, hf_greedy, wait_idle

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    e = Engine(dtype="float32", max_total_tokens=8192, chunked_prefill_size=64)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    return ids, hf_greedy(engine.core.model_path, ids, GREEDY["max_new_tokens"])


@pytest.fixture(autouse=True)
def invariant(request):
    yield
    if "engine" in request.fixturenames:
        assert_kv_invariant(request.getfixturevalue("engine"))


def test_greedy_matches_hf_alone_and_batched(engine, reference):
    ids, expected = reference
    engine.flush_cache()
    alone = [engine.generate(input_ids=i, sampling_params=GREEDY)["output_ids"] for i in ids]
    assert alone == expected
    engine.flush_cache()
    batched = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batched] == expected
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in batched)


def test_replica_stats_carry_the_engine_steps_by_part(engine):
    before = engine.replica_stats()
    engine.generate(input_ids=[1, 2, 3, 4], sampling_params=GREEDY)
    # a prefill and then a decode step per further token, each timed by part; the engine thread
    # records a step after it delivers the step's tokens, so the last one may land just after
    steps = GREEDY["max_new_tokens"]
    deadline = time.monotonic() + 10
    while (after := engine.replica_stats()).step_steps - before.step_steps < steps:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.01)
    assert after.step_forward_s > before.step_forward_s and after.step_sample_s > before.step_sample_s
    assert after.step_schedule_s > before.step_schedule_s and after.step_text_s >= before.step_text_s


def test_text_and_meta_info(engine):
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The capital of France is"))
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 8
    assert meta["e2e_latency"] > 0


def test_prefix_reuse_reports_cached_tokens_and_same_output(engine):
    engine.flush_cache()
    system = "You are a helpful assistant who answers briefly and precisely. " * 8
    first = engine.generate(system + "What is 2+2?", GREEDY)
    prefix_len = len(engine.tokenizer.encode(system.rstrip()))
    second = engine.generate(system + "Name a colour.", GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert prefix_len - 2 <= second["meta_info"]["cached_tokens"] <= prefix_len + 1
    # Reusing the prefix must not change the output.
    engine.flush_cache()
    fresh = engine.generate(system + "Name a colour.", GREEDY)
    assert fresh["output_ids"] == second["output_ids"]
    assert fresh["meta_info"]["cached_tokens"] == 0
    # An identical prompt reuses all but its last token.
    again = engine.generate(system + "Name a colour.", GREEDY)
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    assert again["output_ids"] == fresh["output_ids"]


def test_sampling_seed_reproducible_and_n(engine):
    # Same seed, same numerics: each run starts from the same cache state (a different cached
    # prefix length changes float rounding, which a sampled draw may amplify).
    p = {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    engine.flush_cache()
    a = engine.generate("Once upon a time", p)
    engine.flush_cache()
    b = engine.generate("Once upon a time", p)
    assert a["output_ids"] == b["output_ids"]
    engine.flush_cache()
    many = engine.generate("Once upon a time", dict(p, n=3))
    assert len(many) == 3
    assert many[0]["output_ids"] == a["output_ids"]  # sequence i uses seed + i
    assert len({tuple(o["output_ids"]) for o in many}) > 1


def test_stop_strings_and_stop_token_ids(engine):
    base = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 12, "temperature": 0})
    text = base["text"]
    assert "6" in text
    out = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 12, "temperature": 0, "stop": ["6"]})
    assert out["text"] == text[: text.index("6")]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "6"}
    tok = base["output_ids"][2]
    out = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [tok]})
    assert out["output_ids"] == base["output_ids"][:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}


def test_logprobs(engine):
    out = engine.generate(
        "The capital of France is",
        {"max_new_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    )
    # SGLang's triples: [logprob, token id, token text], alternatives best first.
    lps = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert "".join(text for _, _, text in lps) == out["text"]
    for (lp, tok, _), top in zip(lps, tops):
        assert len(top) == 2 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-4  # greedy = best


def test_streaming_deltas_concatenate(engine):
    async def run():
        chunks = []
        async for c in await engine.async_generate(
            "Write a haiku about the sea.", {"max_new_tokens": 12, "temperature": 0}, stream=True
        ):
            chunks.append(c)
        return chunks

    chunks = asyncio.run(run())
    full = engine.generate("Write a haiku about the sea.", {"max_new_tokens": 12, "temperature": 0})
    assert len(chunks) > 1
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]


def test_invalid_requests_are_refused(engine):
    with pytest.raises(InvalidRequest):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(InvalidRequest) as e:
        engine.generate("hi", {"max_new_tokens": 10**6})
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest):
        engine.generate(input_ids=[10**9])
    with pytest.raises(InvalidRequest):
        engine.generate("hi", {"bogus": 1})


def test_hostile_sampling_parameters_harm_nobody(engine, reference):
    """A denormal temperature once made the sampler emit an id past the vocabulary and failed the
    whole batch: now it means greedy, beside ordinary requests."""
    ids, expected = reference
    tiny = [dict(GREEDY, temperature=t) for t in (1e-45, 1e-44, 5e-7)]
    outs = engine.generate(input_ids=ids[:3] + ids[:1], sampling_params=tiny + [GREEDY])
    assert [o["output_ids"] for o in outs] == expected[:3] + expected[:1]
    for params in (
        {"repetition_penalty": 1e-45},
        {"seed": 2**64},
        {"min_new_tokens": 9, "max_new_tokens": 8},
    ):
        with pytest.raises(InvalidRequest):
            engine.generate("hi", params)


def test_abort_queued_and_running_frees_kv(engine):
    async def run():
        long = GenerateRequest(
            engine.tokenizer.encode("Tell me a long story."),
            SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True),
            stream=True,
        )
        s = engine.submit(long)
        first = await s.__anext__()  # running
        assert not first.finished
        assert engine.abort(long.rid)
        rest = [c async for c in s]
        return rest[-1]

    last = asyncio.run(run())
    assert last.finished and last.finish_reason["type"] == "abort"
    assert last.completion_tokens < 2000
    wait_idle(engine)


@pytest.fixture(scope="module")
def small():
    """One sequence runs at a time and four may wait, over a 2048-token KV pool."""
    e = Engine(
        dtype="float32",
        max_total_tokens=2048,
        max_running_requests=1,
        max_queued_requests=4,
        chunked_prefill_size=512,
    )
    yield e
    e.shutdown()


def assert_nothing_left(e):
    assert_kv_invariant(e)
    inflight = e.core.inflight
    assert not inflight.by_rid and not inflight.unsent and not inflight.streaming
    assert not e._streams and e._open_sequences == 0 and e.num_queued() == 0


def test_the_queue_counts_sequences_and_a_refusal_leaves_no_trace(small):
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    n = lambda k: dataclasses.replace(params, n=k)

    async def run():
        a = small.submit(GenerateRequest([1, 2, 3], params, stream=True))
        await a.__anext__()  # a's sequence is running
        b = small.submit(GenerateRequest([4, 5, 6], n(3)))  # three sequences wait
        assert small.num_queued() == 3
        refused = [GenerateRequest([7, 8, 9], n(2), stream=True), GenerateRequest([7], n(5))]
        with pytest.raises(QueueFull):
            small.submit(refused[0])  # 3 + 2 > 4
        with pytest.raises(InvalidRequest) as e:
            small.submit(refused[1])  # could never be queued
        assert e.value.param == "n"
        c = small.submit(GenerateRequest([10, 11], params, stream=True))  # 3 + 1 == 4
        assert small.num_queued() == 4
        with pytest.raises(QueueFull):
            small.submit(GenerateRequest([12], params))
        assert not {r.rid for r in refused} & set(small._streams)
        for s in (a, b, c):
            small.abort(s.rid)
        return [[chunk async for chunk in s] for s in (a, b, c)]

    rest_a, rest_b, rest_c = asyncio.run(run())
    assert rest_a[-1].finish_reason["type"] == "abort"
    assert [c.finish_reason["type"] for c in rest_b] == ["abort"] * 3
    assert rest_c[-1].finish_reason["type"] == "abort"
    wait_idle(small)
    assert_nothing_left(small)  # the refused streaming request is not in `streaming` either


def test_requests_that_cannot_fit_the_kv_pool_are_refused_at_once(small):
    with pytest.raises(InvalidRequest) as e:
        small.generate(input_ids=[5] * 1500, sampling_params={"max_new_tokens": 1000, "temperature": 0})
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    assert e.value.message == (
        "the prompt (1500 tokens) and the completion (1000 tokens) do not fit in this replica's KV "
        "cache (2048 tokens); reduce the prompt or the completion length"
    )
    prompt = [100 + i % 3000 for i in range(2041)]
    with pytest.raises(InvalidRequest):  # 2041 + 9 - 1 slots: one too many
        small.generate(input_ids=prompt, sampling_params={"max_new_tokens": 9, "temperature": 0})
    with pytest.raises(InvalidRequest) as e:
        small.generate(input_ids=prompt * 2, sampling_params={"max_new_tokens": 1})
    assert e.value.param == "prompt"
    # Exactly the whole pool: it runs to the end.
    out = small.generate(
        input_ids=prompt[:2040], sampling_params={"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    )
    assert out["meta_info"]["completion_tokens"] == 9
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert_nothing_left(small)


def test_make_reqs_touches_no_engine_state(small):
    reqs = small.core.make_reqs(
        GenerateRequest([1, 2, 3], SamplingParams(n=2, regex="(unclosed"), stream=True, rid="pure")
    )
    assert [r.key for r in reqs] == ["pure#0", "pure#1"]  # the grammar is checked later, off-loop
    assert_nothing_left(small)


def test_a_further_attempt_runs_beside_its_earlier_self_and_abort_reaches_both(engine):
    """A request sent again goes out as `attempt_rid(rid, ...)`: the engine takes it while the
    first attempt still runs (its abort may not have landed yet), and aborting `rid` ends both."""

    async def run():
        params = SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True)
        ids = engine.tokenizer.encode("Tell me a long story.")
        first = GenerateRequest(ids, params, rid="story", stream=True)
        again = GenerateRequest(ids, params, rid=attempt_rid("story", "2"), stream=True)
        streams = [engine.submit(first), engine.submit(again)]
        for s in streams:
            assert not (await s.__anext__()).finished
        with pytest.raises(InvalidRequest, match="already in use"):
            engine.submit(GenerateRequest(ids, params, rid="story", stream=True))
        assert not engine.abort("stor")  # a prefix of the id is not the request
        assert engine.abort("story")
        return [[c async for c in s][-1] for s in streams]

    lasts = asyncio.run(run())
    assert all(last.finished and last.finish_reason["type"] == "abort" for last in lasts)
    wait_idle(engine)


def _resumed(engine, ids, params, prefix):
    req = GenerateRequest(list(ids), SamplingParams.from_dict(params), output_prefix=prefix)
    return asyncio.run(engine._collect(req))


def test_a_resumed_request_continues_as_if_it_had_generated_its_prefix(engine, reference):
    """PD recompute: prompt + the tokens a client has, continued; only the rest comes back, and
    the usage counts the prefix as output. Greedy, so it equals the uninterrupted run."""
    ids, _ = reference
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    (whole,) = [engine.generate(input_ids=ids[0], sampling_params=params)]
    full = whole["output_ids"]
    for k in (1, 5, 11):
        (out,) = _resumed(engine, ids[0], params, [full[:k]])
        assert out["output_ids"] == full[k:]
        assert whole["text"].startswith(engine.tokenizer.decode(full[:k])) and whole["text"].endswith(
            out["text"]
        )
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 12 and meta["prompt_tokens"] == len(ids[0])
        assert meta["cached_tokens"] <= len(ids[0])
    # n = 2: each sequence from its own prefix.
    outs = _resumed(engine, ids[0], dict(params, n=2), [full[:3], full[:7]])
    assert [o["output_ids"] for o in outs] == [full[3:], full[7:]]
    # A stop string inside the prefix's tail ends it at once, with nothing new.
    text = engine.tokenizer.decode(full[:6])
    (out,) = _resumed(engine, ids[0], dict(params, stop=[text[-3:]]), [full[:6]])
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "stop"
    wait_idle(engine)


def test_a_resumed_request_is_validated(engine):
    ids = engine.tokenizer.encode("hello")
    params = {"max_new_tokens": 4, "temperature": 0}
    for prefix, why in (
        ([[1], [2]], "one token list per sequence"),
        ([[1, 2, 3, 4]], "no token"),
        ([[-1]], "integers"),
    ):
        with pytest.raises(InvalidRequest, match=why):
            _resumed(engine, ids, params, prefix)
