"""PDStream, the ingress's side of one PD request, against scripted replica calls: the order of
the calls, what each side is sent, the client's view of the two streams, and each failure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError
from ray.serve.handle import DeploymentResponseGenerator

from radixserve.router.frontend.ingress import Ingress
from radixserve.router.frontend.metrics import Metrics
from radixserve.router.frontend.pd_stream import RECOMPUTE_TAG, PDStream
from radixserve.workers.protocol import (
    EngineError,
    GenerateRequest,
    KVReservation,
    OutputChunk,
    QueueFull,
    SamplingParams,
    TransferFailed,
    attempt_rid,
    encode_error,
)

PROMPT = [5, 6, 7]
TICKET = {"transfer_id": "t", "endpoint": {}, "dst_slots": [1, 2, 3], "held_tokens": 0}


class ScriptedCall(DeploymentResponseGenerator):
    """A streaming call that yields `items` (an exception is raised in its place)."""

    def __init__(self, items: list[Any]):  # no Serve machinery behind it
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedPool:
    """A deployment handle whose calls answer from a script, per method, in order."""

    def __init__(self, **scripts: list[list[Any]]):
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.calls: list[tuple[str, dict]] = []
        self.streams: list[ScriptedCall] = []

    def options(self, **_: Any) -> ScriptedPool:
        return self

    def __getattr__(self, method: str):
        pool = self

        class Method:
            def remote(self, request: dict) -> ScriptedCall:
                pool.calls.append((method, request))
                call = ScriptedCall(pool.scripts[method].pop(0))
                pool.streams.append(call)
                return call

        return Method()


def chunk(index=0, ids=(), text="", finished=False, **kw) -> dict:
    return OutputChunk(
        rid="r", index=index, token_ids=list(ids), text=text, finished=finished, **kw
    ).to_dict()


def final(ids, text, completion, **kw) -> dict:
    reason = {"type": "length", "matched": None}
    return chunk(ids=ids, text=text, finished=True, finish_reason=reason, completion_tokens=completion, **kw)


def request(**params) -> GenerateRequest:
    return GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=4, **params), rid="r", stream=True)


def run(stream: PDStream) -> list[OutputChunk]:
    async def go():
        await stream.open()
        return [c async for c in stream]

    return asyncio.run(go())


def prefill_ok(first=(11,)) -> list[Any]:
    # acceptance, then the first token as the prefill replica sends it (its own end marks on)
    return [chunk(), chunk(ids=first, text="A", finished=True, finish_reason={"type": "handoff"})]


def make(decode_script, prefill_scripts, on_failure="recompute", req=None, decode_generate=()):
    decode = ScriptedPool(reserve=[decode_script], generate=list(decode_generate))
    prefill = ScriptedPool(generate=prefill_scripts)
    s = PDStream(req or request(), prefill, decode, Metrics("m").timer(), on_failure)  # type: ignore[arg-type]
    return s, prefill, decode


def test_reserve_then_prefill_with_the_tickets_then_decode():
    reservation = KVReservation("r", [TICKET]).to_dict()
    s, prefill, decode = make(
        [reservation, chunk(ids=[12], text="B"), final([13, 14], "CD", 4, prompt_tokens=3, cached_tokens=2)],
        [prefill_ok()],
    )
    out = run(s)
    assert [c.token_ids for c in out] == [[11], [12], [13, 14]]
    assert "".join(c.text for c in out) == "ABCD"
    assert not out[0].finished and out[0].finish_reason is None  # the prefill's end is not the client's
    assert out[-1].finished and out[-1].completion_tokens == 4 and out[-1].cached_tokens == 2
    ((method, sent),) = prefill.calls
    assert method == "generate" and sent["kv_tickets"] == [TICKET] and sent["input_ids"] == PROMPT
    assert decode.calls[0][0] == "reserve" and "kv_tickets" not in decode.calls[0][1]


def test_a_refused_reservation_is_the_clients_refusal_and_nothing_is_prefilled():
    s, prefill, _ = make([encode_error(QueueFull("full"))], [])
    with pytest.raises(QueueFull):
        run(s)
    assert prefill.calls == []


def test_a_prefill_failure_before_output_cancels_the_reservation():
    s, _, decode = make([KVReservation("r", [TICKET]).to_dict()], [[encode_error(EngineError("boom"))]])
    with pytest.raises(EngineError):
        run(s)
    assert decode.streams[0].cancelled


@pytest.mark.parametrize("on_failure", ["recompute", "error"])
def test_transfer_failure_after_the_first_token(on_failure):
    reservation = KVReservation("r", [TICKET]).to_dict()
    recompute = [
        chunk(),
        chunk(ids=[12], text="B"),
        final([13, 14], "CD", 4, prompt_tokens=3, cached_tokens=3),
    ]
    s, _, decode = make(
        [reservation, encode_error(TransferFailed("KV transfer failed: timed out"))],
        [prefill_ok()],
        on_failure,
        decode_generate=[recompute],
    )
    if on_failure == "error":
        with pytest.raises(EngineError, match="decode side failed after the prefill"):
            run(s)
        return
    out = run(s)
    assert [t for c in out for t in c.token_ids] == [11, 12, 13, 14]
    # The rest was asked of the decode pool (alive; only the transfer failed): the prompt, resumed
    # from the token the client has (the replica counts it as output: the usage is the request's).
    method, cont = decode.calls[1]
    assert method == "generate" and cont["input_ids"] == PROMPT and cont["output_prefix"] == [[11]]
    assert cont["sampling_params"]["max_new_tokens"] == 4 and cont["rid"] == attempt_rid("r", RECOMPUTE_TAG)
    assert (out[-1].prompt_tokens, out[-1].completion_tokens, out[-1].cached_tokens) == (3, 4, 3)


def test_a_lost_decode_replica_is_recomputed_on_the_prefill_pool_grammar_and_all():
    reservation = KVReservation("r", [TICKET]).to_dict()
    lost = RuntimeError("actor died")
    recompute = [chunk(), final([12, 13, 14], "BCD", 4, prompt_tokens=3)]
    s, prefill, _ = make([reservation, lost], [prefill_ok(), recompute], req=request(regex="[A-Z]+"))
    assert [t for c in run(s) for t in c.token_ids] == [11, 12, 13, 14]
    cont = prefill.calls[1][1]
    assert cont["input_ids"] == PROMPT and cont["output_prefix"] == [[11]] and "kv_tickets" not in cont
    assert cont["sampling_params"]["regex"] == "[A-Z]+"  # the replica replays [11] through it


def test_a_recompute_resumes_only_the_unfinished_sequences_under_their_own_indices():
    reservation = KVReservation("r", [TICKET, TICKET]).to_dict()
    first = [chunk(), chunk(0, [11], "A", True), chunk(1, [21], "a", True)]
    decode = [reservation, final([12], "B", 2) | {"index": 0}, chunk(1, [22], "b"), RuntimeError("lost")]
    # The replica numbers the one sequence it resumes 0; the client sees it as 1.
    recompute = [chunk(), final([23, 24], "cd", 4, prompt_tokens=3)]
    s, prefill, _ = make(decode, [first, recompute], req=request(n=2))
    out = run(s)
    by_index = {i: [t for c in out if c.index == i for t in c.token_ids] for i in (0, 1)}
    assert by_index == {0: [11, 12], 1: [21, 22, 23, 24]}
    assert [c.index for c in out if c.finished] == [0, 1]
    cont = prefill.calls[1][1]
    assert cont["sampling_params"]["n"] == 1 and cont["output_prefix"] == [[21, 22]]


def test_cancel_cancels_both_calls():
    reservation = KVReservation("r", [TICKET]).to_dict()
    s, prefill, decode = make([reservation, chunk(ids=[12])], [prefill_ok() + [chunk(ids=[99])]])

    async def go():
        await s.open()
        s.cancel()

    asyncio.run(go())
    assert decode.streams[0].cancelled and prefill.streams[0].cancelled


def test_a_resend_after_a_lost_prefill_replica_goes_out_under_a_fresh_id():
    """The prefill replica is lost before any output: the ingress cancels the reservation and
    sends the request again. The decode side may still hold the first reservation (its cancel is
    on its way), so the resend must not reuse the rid: it goes out as attempt 2 of it."""
    reservation = KVReservation("r", [TICKET]).to_dict()
    decode = ScriptedPool(reserve=[[reservation], [reservation, final([12], "B", 2)]])
    prefill = ScriptedPool(generate=[[ActorUnavailableError("lost", b"\0" * 16)], prefill_ok()])
    ing = Ingress.__new__(Ingress)  # the open/resend logic alone, without Serve behind it
    ing.replicas, ing.decode, ing.metrics = prefill, decode, Metrics("m")
    ing.config = SimpleNamespace(pd_on_failure="recompute", pd_local_prefill_tokens=0)  # type: ignore[assignment]

    async def go():
        stream = await ing.open(request())
        return [c async for c in stream]

    out = asyncio.run(go())
    assert [t for c in out for t in c.token_ids] == [11, 12]
    assert decode.streams[0].cancelled
    rids = [(m, r["rid"]) for m, r in decode.calls + prefill.calls]
    assert rids == [
        ("reserve", "r"),
        ("reserve", attempt_rid("r", "2")),
        ("generate", "r"),
        ("generate", attempt_rid("r", "2")),
    ]


def test_a_prompt_under_the_local_prefill_bound_is_served_whole_by_a_decode_replica():
    """pd_local_prefill_tokens: a prompt this short skips the prefill pool and the transfer; a
    longer one is disaggregated as usual."""
    reservation = KVReservation("r", [TICKET]).to_dict()
    decode = ScriptedPool(
        generate=[[chunk(), final([11, 12], "AB", 2)]], reserve=[[reservation, final([12], "B", 2)]]
    )
    prefill = ScriptedPool(generate=[prefill_ok()])
    ing = Ingress.__new__(Ingress)
    ing.replicas, ing.decode, ing.metrics = prefill, decode, Metrics("m")
    ing.config = SimpleNamespace(pd_on_failure="recompute", pd_local_prefill_tokens=len(PROMPT))  # type: ignore[assignment]

    async def go(req):
        stream = await ing.open(req)
        return [c async for c in stream]

    out = asyncio.run(go(request()))
    assert [t for c in out for t in c.token_ids] == [11, 12]
    assert [m for m, _ in decode.calls] == ["generate"] and prefill.calls == []
    longer = GenerateRequest(PROMPT + [8], SamplingParams(max_new_tokens=4), rid="s", stream=True)
    asyncio.run(go(longer))
    assert [m for m, _ in decode.calls] == ["generate", "reserve"] and len(prefill.calls) == 1
