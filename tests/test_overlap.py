"""Overlap mode (text of step N produced while the forward of step N+1 runs) gives exactly the
outputs of the serial loop, on the default model in float32."""

import asyncio
import json
import threading

import pytest
import torch

from radixserve.workers import Engine
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.protocol import GenerateRequest, SamplingParams
from tests.engine_utils import assert_kv_invariant

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
]
# Longer than the 64-token prefill chunk: its chunks run alongside the others' decode steps.
LONG = "You are a helpful assistant who answers briefly and precisely. " * 8 + "What is 2+2?"


@pytest.fixture(scope="module")
def engines():
    # Every token its own chunk (stream_interval_ms 0): how many chunks a stream has then depends
    # on the tokens alone, not on how long the steps took.
    common = dict(dtype="float32", max_total_tokens=8192, chunked_prefill_size=64, stream_interval_ms=0)
    on = Engine(enable_overlap=True, **common)
    off = Engine(enable_overlap=False, **common)
    assert on.core.overlap and not off.core.overlap
    yield on, off
    on.shutdown()
    off.shutdown()


@pytest.fixture(autouse=True)
def invariant(engines):
    yield
    for e in engines:
        assert_kv_invariant(e)
        assert not e.core.outputs.pending and not e.core.inflight.unsent and not e.core.inflight.by_rid


def generated(e):
    return e.stats()["generation_tokens_total"]


def both(engines, prompts, params):
    """The same request on both engines, each starting from an empty cache."""
    outs = []
    for e in engines:
        assert e.flush_cache()
        outs.append(e.generate(prompts, params))
    return outs


def summary(outs):
    return [
        (
            o["text"],
            o["output_ids"],
            o["meta_info"]["completion_tokens"],
            o["meta_info"]["prompt_tokens"],
            o["meta_info"]["finish_reason"],
        )
        for o in outs
    ]


def test_greedy_batch_identical(engines):
    on, off = both(engines, PROMPTS + [LONG], {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert summary(on) == summary(off)
    assert all(o["meta_info"]["completion_tokens"] == 16 for o in on)
    assert on[0]["text"] == engines[0].tokenizer.decode(on[0]["output_ids"])


def test_stop_strings_drop_the_extra_token(engines):
    on_engine, off_engine = engines
    dropped = [e.stats()["dropped_tokens_total"] for e in engines]
    counted = [generated(e) for e in engines]
    params = [
        {"max_new_tokens": 24, "temperature": 0, "stop": s} for s in (["."], ["\n"], ["sea"], ["6"], [" is"])
    ]
    on, off = both(engines, PROMPTS + [LONG], params)
    assert summary(on) == summary(off)
    assert [o["meta_info"]["finish_reason"]["type"] for o in on].count("stop") >= 3
    for o in on:
        assert len(o["output_ids"]) == o["meta_info"]["completion_tokens"]
    total = sum(o["meta_info"]["completion_tokens"] for o in on)
    assert [generated(e) - c for e, c in zip(engines, counted)] == [total, total]
    # Each stop string was found while the next step ran: that step's token was dropped.
    assert on_engine.stats()["dropped_tokens_total"] - dropped[0] >= 3
    assert off_engine.stats()["dropped_tokens_total"] == dropped[1] == 0


def test_streamed_stop_never_sends_the_extra_token(engines):
    params = {"max_new_tokens": 20, "temperature": 0, "stop": ["6"]}

    async def stream(e):
        chunks = []
        async for c in await e.async_generate("1, 2, 3, 4,", params, stream=True):
            chunks.append(c)
        return chunks

    results = []
    for e in engines:
        results.append(asyncio.run(stream(e)))
        # The stopped sequence's KV is still held (released at the next step boundary, after the
        # forward that included it); a flush right after the answer must still succeed.
        assert e.flush_cache()
    final = [r[-1] for r in results]
    assert final[0]["text"] == final[1]["text"] == " 5, "
    assert final[0]["output_ids"] == final[1]["output_ids"]
    assert final[0]["meta_info"]["completion_tokens"] == len(final[0]["output_ids"])
    assert len(results[0]) == len(results[1])


def test_n_greater_than_one_identical(engines):
    seeded = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 77, "n": 3}
    on, off = both(engines, "Once upon a time", seeded)
    assert summary(on) == summary(off) and len(on) == 3
    assert len({tuple(o["output_ids"]) for o in on}) > 1
    greedy = {"max_new_tokens": 12, "temperature": 0, "n": 2, "stop": [","]}
    on, off = both(engines, ["1, 2, 3, 4,", "The capital of France is"], greedy)
    assert summary(on) == summary(off) and len(on) == 4


def test_constrained_requests_in_the_same_batch(engines):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    params = [
        {"max_new_tokens": 40, "temperature": 0, "regex": r"Answer: [0-9]{1,3}, [0-9]{1,3}\."},
        # Grammar + stop string: jump-forward tokens are checked one at a time.
        {"max_new_tokens": 40, "temperature": 0, "regex": r"Answer: [0-9]{1,3}, [0-9]{1,3}\.", "stop": [","]},
        {"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(schema)},
        {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
    ]
    prompts = ["Two numbers:", "Two numbers:", "A city as JSON:", "The capital of France is"]
    on, off = both(engines, prompts, params)
    assert summary(on) == summary(off)
    assert on[0]["text"].startswith("Answer: ") and on[0]["text"].endswith(".")
    assert on[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}
    assert on[1]["text"] == on[0]["text"].split(",")[0]
    json.loads(on[2]["text"])
    assert engines[0].stats()["jump_forward_tokens_total"] > 0


def test_abort_mid_stream(engines):
    async def run(e):
        req = GenerateRequest(
            e.tokenizer.encode("Tell me a long story."),
            SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True),
            stream=True,
        )
        other = asyncio.ensure_future(
            e.async_generate(
                "The capital of France is", {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
            )
        )
        s = e.submit(req)
        chunks = [await s.__anext__() for _ in range(3)]
        assert e.abort(req.rid)
        chunks += [c async for c in s]
        return chunks, await other

    for e in engines:
        chunks, other = asyncio.run(run(e))
        last = chunks[-1]
        assert last.finished and last.finish_reason["type"] == "abort"
        assert sum(len(c.token_ids) for c in chunks) == last.completion_tokens < 500
        assert other["meta_info"]["completion_tokens"] == 30


def test_step_stats_report_hidden_host_time(engines):
    on, off = (e.stats() for e in engines)
    assert on["step_hidden_s"] > 0 and 0 < on["step_host_hidden_fraction"] <= 1
    assert on["decode_hidden_ms_avg"] <= on["decode_text_ms_avg"]
    assert off["step_hidden_s"] == 0 and off["step_host_hidden_fraction"] == 0
    assert off["decode_text_ms_avg"] > 0 and off["decode_forward_ms_avg"] > 0


def test_overlap_is_off_on_cpu_and_on_on_cuda_unless_asked_otherwise():
    assert EngineConfig().overlap("cpu") is False
    assert EngineConfig().overlap("cuda") is True
    for kind in ("cpu", "cuda"):
        assert EngineConfig(enable_overlap=True).overlap(kind) is True
        assert EngineConfig(enable_overlap=False).overlap(kind) is False


@pytest.mark.parametrize("overlap,thread", [(True, "radixserve-forward"), (False, "radixserve-engine")])
def test_forward_threads_use_the_configured_thread_count(overlap, thread):
    """torch's thread count is per thread: the thread that runs forwards must adopt num_threads."""
    before = torch.get_num_threads()
    e = Engine(dtype="float32", max_total_tokens=1024, num_threads=1, enable_overlap=overlap)
    seen = []
    forward = e.core.runner.forward

    def spy(batch):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return forward(batch)

    e.core.runner.forward = spy
    try:
        assert (
            e.generate("Hi", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2
        )
        assert seen and all(s == (thread, 1) for s in seen)
    finally:
        e.shutdown()
        torch.set_num_threads(before)
