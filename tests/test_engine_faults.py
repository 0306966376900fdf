"""Failures stay with the request that causes them. Faults are injected through the engine's test
hook (ForwardWorker.fault_hook) into one request; that request ends with an EngineError (never a
silent "abort"), the others finish with their normal greedy output, and no KV is left behind.
Serial and overlap loops both, on the default model in float32."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from radixserve.workers import Engine
from radixserve.workers.protocol import (
    Accepted,
    CacheSummary,
    EngineError,
    Failure,
    GenerateRequest,
    InvalidRequest,
    OutputChunk,
    SamplingParams,
    decode_event,
)
from tests.engine_utils import assert_kv_invariant

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3, 4,"]
FAULTY_PROMPT = "Tell me a story about a dragon."
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def engine(request):
    e = Engine(
        dtype="float32",
        max_total_tokens=4096,
        chunked_prefill_size=64,
        enable_overlap=request.param,
        stream_interval_ms=0,  # a chunk per token: the tests count what came before a failure
    )
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def expected(engine):
    """Each prompt's greedy output, alone (greedy output does not depend on the batch)."""
    return {p: engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS + [FAULTY_PROMPT]}


@pytest.fixture(autouse=True)
def nothing_left(engine):
    engine.core.worker.fault_hook = None
    yield
    engine.core.worker.fault_hook = None
    assert_kv_invariant(engine)
    inflight = engine.core.inflight
    assert not inflight.by_rid and not inflight.unsent and not inflight.streaming
    assert not engine.core.outputs.pending and not engine._streams and engine._open_sequences == 0


def fault(stage: str, after: int = 0):
    """A hook failing `stage` for the request whose id starts with "faulty", once it has `after`
    output tokens."""

    def hook(s, req):
        if s == stage and req.rid.startswith("faulty") and len(req.output_ids) >= after:
            raise RuntimeError(f"injected {stage} fault")

    return hook


def request(engine, prompt: str, rid: str | None = None) -> GenerateRequest:
    kw = {"rid": rid} if rid else {}
    return GenerateRequest(
        engine.tokenizer.encode(prompt), SamplingParams.from_dict(GREEDY), stream=True, **kw
    )


async def collect(stream, chunks=None) -> tuple[list[OutputChunk], Exception | None]:
    chunks = list(chunks or [])
    try:
        async for c in stream:
            chunks.append(c)
    except EngineError as e:
        return chunks, e
    return chunks, None


def tokens(chunks: list[OutputChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def assert_healthy(results, expected):
    for prompt, (chunks, error) in zip(PROMPTS, results):
        assert error is None
        assert tokens(chunks) == expected[prompt]
        assert chunks[-1].finished and chunks[-1].finish_reason["type"] == "length"


def assert_failed(chunks, error, expected_tokens, at_least=0):
    """An EngineError ended the stream; what came before it is a prefix of the normal output."""
    assert isinstance(error, EngineError)
    assert not any(c.finished for c in chunks)  # no final chunk, no "abort"
    got = tokens(chunks)
    assert at_least <= len(got) and got == expected_tokens[: len(got)]


@pytest.mark.parametrize("after", [0, 3], ids=["first-token", "mid-stream"])
@pytest.mark.parametrize("stage", ["prepare", "sample", "tokens", "text"])
def test_a_faulty_request_fails_alone(engine, expected, stage, after):
    engine.core.worker.fault_hook = fault(stage, after)
    failed_before = engine.stats()["num_failed_total"]

    async def run():
        reqs = [request(engine, p) for p in PROMPTS] + [request(engine, FAULTY_PROMPT, f"faulty-{stage}")]
        streams = [engine.submit(r) for r in reqs]  # submitted together: they share every step
        return await asyncio.gather(*(collect(s) for s in streams))

    *healthy, (chunks, error) = asyncio.run(run())
    assert_healthy(healthy, expected)
    assert f"injected {stage} fault" in str(error)
    # The text stage fails before the chunk of the token it is working on goes out.
    assert_failed(chunks, error, expected[FAULTY_PROMPT], at_least=after - (stage == "text"))
    assert len(tokens(chunks)) <= after
    assert engine.stats()["num_failed_total"] == failed_before + 1


def test_a_failing_forward_fails_its_batch_and_nothing_else(engine, expected):
    """The faulty request's prefill runs in a batch of its own while the others decode."""
    engine.core.worker.fault_hook = fault("forward")

    async def run():
        streams = [engine.submit(request(engine, p)) for p in PROMPTS]
        firsts = [[await s.__anext__()] for s in streams]  # every prefill is done
        faulty = engine.submit(request(engine, FAULTY_PROMPT, "faulty-forward"))
        return await asyncio.gather(collect(faulty), *(collect(s, f) for s, f in zip(streams, firsts)))

    (chunks, error), *healthy = asyncio.run(run())
    assert_failed(chunks, error, expected[FAULTY_PROMPT])
    assert chunks == []
    assert_healthy(healthy, expected)


def test_a_failing_decode_forward_fails_every_request_in_its_batch(engine, expected):
    engine.core.worker.fault_hook = fault("forward", after=2)

    async def run():
        reqs = [request(engine, p) for p in PROMPTS] + [request(engine, FAULTY_PROMPT, "faulty-decode")]
        streams = [engine.submit(r) for r in reqs]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(run())
    for prompt, (chunks, error) in zip(PROMPTS + [FAULTY_PROMPT], results):
        # They decode in one batch: the step that would compute the third token fails for all.
        assert_failed(chunks, error, expected[prompt], at_least=2)
    engine.core.worker.fault_hook = None
    assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == expected[PROMPTS[0]]  # serving on


def test_the_replica_sends_an_engine_error_as_an_error_message(engine, expected):
    from radixserve.workers.replica import EngineReplica

    replica = object.__new__(EngineReplica.func_or_class)
    replica.engine, replica.replica_id = engine, "test"
    engine.core.worker.fault_hook = fault("sample", after=2)
    req = request(engine, FAULTY_PROMPT, "faulty-replica")

    async def run():
        return [decode_event(m) async for m in replica.generate(req.to_dict())]

    try:
        events = asyncio.run(run())
    finally:
        replica.engine = None  # the test's engine outlives this replica object
    assert events[0] == Accepted(req.rid)
    assert isinstance(events[-1], Failure) and type(events[-1].error) is EngineError
    chunks = events[1:-1]
    assert all(isinstance(c, OutputChunk) for c in chunks)
    assert_failed(chunks, EngineError(), expected[FAULTY_PROMPT], at_least=2)


def test_grammars_are_checked_and_built_on_the_engine_thread(engine, monkeypatch):
    import radixserve.workers.engine.grammar_queue as grammar_queue

    built_on = []

    class Spy(grammar_queue.GrammarBackend):
        def __init__(self, *args, **kwargs):
            built_on.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(grammar_queue, "GrammarBackend", Spy)
    engine.core.grammars._backend = None  # as in a fresh engine: none is built before it is needed
    bad = GenerateRequest([1, 2, 3], SamplingParams(regex="(unclosed"))
    assert len(engine.core.make_reqs(bad)) == 1  # the caller's thread does not parse it
    assert built_on == []
    with pytest.raises(InvalidRequest) as e:
        engine.generate("Answer:", {"regex": "(unclosed", "max_new_tokens": 5})
    assert e.value.param == "regex"
    out = engine.generate("Answer:", {"regex": "(yes|no)", "max_new_tokens": 5, "temperature": 0})
    assert out["text"] in ("yes", "no")
    assert built_on == ["radixserve-engine"]


def test_replica_calls_that_wait_for_the_engine_leave_its_event_loop_free(engine):
    """flush_cache and cache_summary wait for a step boundary; the replica's event loop keeps
    serving meanwhile (here: a ticker), even while steps are slow."""
    from radixserve.workers.engine.config import EngineConfig
    from radixserve.workers.replica import EngineReplica

    replica = object.__new__(EngineReplica.func_or_class)
    replica.engine, replica.replica_id, replica.config = engine, "test", EngineConfig()
    engine.core.worker.fault_hook = lambda stage, req: time.sleep(0.3) if stage == "forward" else None

    async def run():
        busy = asyncio.ensure_future(engine.async_generate(PROMPTS[0], dict(GREEDY, max_new_tokens=3)))
        while not engine.core.scheduler.running:
            await asyncio.sleep(0.005)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        flushed = await replica.flush_cache()
        during_flush = ticks
        summary = await replica.cache_summary(100)
        task.cancel()
        card = await replica.model_card()
        return flushed, during_flush, summary, card, await busy

    try:
        flushed, during_flush, summary, card, out = asyncio.run(run())
    finally:
        replica.engine = None
    assert flushed is False  # a request was in flight
    assert during_flush >= 10  # ~0.3 s of waiting, in 5 ms ticks
    assert CacheSummary.from_dict(summary).stats.replica_id == "test"
    assert card["context_length"] == engine.context_length == engine.model_config.context_length
    assert out["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("stage", ["tokens", "text"])
def test_the_watchdog_names_the_request_that_holds_the_engine_thread(engine, expected, stage, caplog):
    """A request's own work that outlives the watchdog's deadline is logged with its id while the
    engine thread is still inside it; the request then finishes normally."""
    watchdog = engine.core.watchdog
    deadline, slow = watchdog.deadline_s, watchdog.slow_s
    # The hook holds the thread until the stall is logged: at least the deadline, so a slow_s
    # below it makes the finished mark's own line certain whatever the watchdog's polling period.
    watchdog.deadline_s, watchdog.slow_s = 0.2, 0.1
    key = f"slow-{stage}#0"

    def hook(s, req):
        if s == stage and req.key == key and len(req.output_ids) == 2:
            give_up = time.monotonic() + 10
            while (watchdog.last_stall or ("", ()))[1] != (key,) and time.monotonic() < give_up:
                time.sleep(0.01)

    engine.core.worker.fault_hook = hook
    try:
        with caplog.at_level("WARNING", logger="radixserve.engine"):

            async def run():
                slow = engine.submit(request(engine, FAULTY_PROMPT, f"slow-{stage}"))
                others = [collect(engine.submit(request(engine, p))) for p in PROMPTS]
                return await asyncio.gather(collect(slow), *others)

            (chunks, error), *healthy = asyncio.run(run())
    finally:
        watchdog.deadline_s, watchdog.slow_s = deadline, slow
    assert error is None and tokens(chunks) == expected[FAULTY_PROMPT]
    assert_healthy(healthy, expected)
    what = {"tokens": "appending a sampled token", "text": "detokenizing"}[stage]
    logged = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    stalls = [m for m in logged if m.startswith(f"the engine thread has been in {what}")]
    assert len(stalls) == 1 and f"(request {key})" in stalls[0], logged
    assert any(m.startswith(what) and " took " in m for m in logged), logged
