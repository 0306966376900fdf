"""The generation endpoints' logic: OpenAI chat and completions, SGLang's native /generate.

Each handler validates and tokenizes, opens one replica stream per prompt (so a refusal becomes
an HTTP status before any byte is sent), then either streams SSE or collects a JSON body. A client
that goes away cancels its streams, which aborts the requests in their replicas.

Text prompts are tokenized on the ingress's tokenizer threads, after a check that needs no
tokenizing: a prompt whose length alone proves it longer than the context is refused at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.router.frontend import errors
from radixserve.router.frontend.responses import (
    SSE_DONE,
    Sequences,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    new_id,
    now,
    sse,
    usage_chunk,
)
from radixserve.router.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateHTTPRequest,
    chat_sampling_params,
    check_prompt_fits,
    check_sequences,
    completion_sampling_params,
    native_sampling_params,
)
from radixserve.router.frontend.tenants import Identity, identity_of
from radixserve.workers.protocol import GenerateRequest, OutputChunk, SamplingParams

if TYPE_CHECKING:
    from radixserve.router.frontend.ingress import Ingress
    from radixserve.router.frontend.ingress import Stream as ReplicaStream

_DONE = object()


def check_model(ing: Ingress, model: str | None) -> None:
    if model is not None and model != ing.model_name:
        raise errors.model_not_found(model)


async def open_streams(ing: Ingress, reqs: list[GenerateRequest]) -> list[ReplicaStream]:
    """Open every prompt's stream, or none: a refusal cancels the ones already admitted."""
    streams: list[ReplicaStream] = []
    try:
        for req in reqs:
            streams.append(await ing.open(req))
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return streams


async def merged(streams: list[ReplicaStream]) -> AsyncIterator[tuple[int, OutputChunk]]:
    """(prompt index, chunk) from all streams as they arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: ReplicaStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((k, chunk))
            queue.put_nowait((k, _DONE))
        except Exception as e:  # surfaced to the consumer, which owns error reporting
            queue.put_nowait((k, e))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            k, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.cancel()


async def client_gone(http: Request) -> None:
    """Returns when the client disconnects: the server's `http.disconnect` message. Call it once
    the request body has been read (what is left to receive is only that message)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def collect(streams: list[ReplicaStream], seqs: Sequences, http: Request) -> bool:
    """Fold every chunk into `seqs`; False (and the requests aborted) if the client left first."""

    async def drain() -> None:
        async for k, chunk in merged(streams):
            seqs.add(k, chunk)

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(client_gone(http))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and gone.exception() is None:
            return False
        await work  # re-raises a replica failure (and outlives a receive channel that failed)
        return True
    finally:
        for t in (work, gone):
            t.cancel()
        for s in streams:
            s.cancel()


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def guarded(events: AsyncIterator[str], http: Request) -> AsyncIterator[str]:
    """A stream that fails after its 200 reports the error in band, then ends with [DONE]."""
    try:
        async for e in events:
            yield e
    except Exception as exc:
        yield errors.from_exception(exc, errors.request_id(http)).sse_event()
    yield SSE_DONE


async def encode_prompt(ing: Ingress, text: str, param: str) -> list[int]:
    """A raw text prompt's ids, on a tokenizer thread; refused unread if it cannot fit."""
    check_prompt_fits(ing.tokenizer.min_tokens(len(text)), ing.card.context_length, param)
    return await ing.tokenizer_pool.run(len(text), ing.tokenizer.encode, text, True, param)


async def encode_chat(ing: Ingress, messages: list[dict[str, Any]]) -> list[int]:
    """The chat's ids, templated on a tokenizer thread; refused unread if it cannot fit."""
    size = sum(len(m["content"]) for m in messages)
    check_prompt_fits(ing.tokenizer.min_tokens(size), ing.card.context_length, "messages")
    return await ing.tokenizer_pool.run(size, ing.tokenizer.encode_chat, messages)


def _requests(
    ids_list: list[list[int]], params: list[SamplingParams], rid: str, stream: bool, who: Identity
) -> list[GenerateRequest]:
    """One request per prompt, in the caller's cache namespace and request-id space."""
    many = len(ids_list) > 1
    return [
        GenerateRequest(
            input_ids=ids,
            sampling_params=p,
            rid=who.engine_rid(f"{rid}-{k}" if many else rid),
            namespace=who.namespace,
            stream=stream,
        )
        for k, (ids, p) in enumerate(zip(ids_list, params))
    ]


async def chat(ing: Ingress, req: ChatCompletionRequest, http: Request) -> Response:
    check_model(ing, req.model)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages
    ]
    check_sequences(1, req.n)
    ids = await encode_chat(ing, messages)
    params = chat_sampling_params(req, len(ids), ing.card.vocab_size, ing.card.context_length)
    rid = req.rid or new_id("chatcmpl")
    streams = await open_streams(ing, _requests([ids], [params], rid, req.stream, identity_of(http)))
    seqs = Sequences(1, params.n)
    if not req.stream:
        if not await collect(streams, seqs, http):
            return Response(status_code=499)
        return JSONResponse(chat_response(rid, ing.model_name, seqs, ing.tokenizer, req.logprobs))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return sse_response(guarded(_chat_events(ing, rid, streams, seqs, req.logprobs, include_usage), http))


async def _chat_events(
    ing: Ingress,
    rid: str,
    streams: list[ReplicaStream],
    seqs: Sequences,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    created, model, started = now(), ing.model_name, set()
    async for k, chunk in merged(streams):
        i = seqs.add(k, chunk)
        if i not in started:
            started.add(i)
            yield sse(chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}))
        if chunk.text or (want_logprobs and chunk.logprobs):
            lps = chat_logprobs(ing.tokenizer, chunk.logprobs or []) if want_logprobs else None
            yield sse(chat_chunk(rid, created, model, i, {"content": chunk.text}, logprobs=lps))
        if chunk.finished:
            s = seqs.choices[i]
            yield sse(chat_chunk(rid, created, model, i, {}, s.finish_reason, matched_stop=s.matched_stop))
    if include_usage:
        yield sse(usage_chunk(rid, created, model, "chat.completion.chunk", seqs.usage()))


async def _prompts(ing: Ingress, prompt: Any, n: int) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt (a string, strings, ids, or lists of ids) and its text."""
    tok = ing.tokenizer
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise errors.bad_request("'prompt' must not be empty", "prompt")
    check_sequences(len(prompt), n)
    ids_list, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids_list.append(await encode_prompt(ing, p, "prompt"))
            texts.append(p)
        else:
            check_prompt_fits(len(p), ing.card.context_length, "prompt")  # before a long scan
            tok.check_ids(p, "prompt")
            if not p:
                raise errors.bad_request("'prompt' must not be empty", "prompt")
            ids_list.append(list(p))
            texts.append(tok.decode(list(p)))
    return ids_list, texts


async def completions(ing: Ingress, req: CompletionRequest, http: Request) -> Response:
    check_model(ing, req.model)
    ids_list, texts = await _prompts(ing, req.prompt, req.n)
    card = ing.card
    params = [
        completion_sampling_params(req, len(ids), card.vocab_size, card.context_length) for ids in ids_list
    ]
    rid = req.rid or new_id("cmpl")
    streams = await open_streams(ing, _requests(ids_list, params, rid, req.stream, identity_of(http)))
    seqs = Sequences(len(ids_list), req.n)
    want_logprobs = req.logprobs is not None
    if not req.stream:
        if not await collect(streams, seqs, http):
            return Response(status_code=499)
        echo = texts if req.echo else None
        return JSONResponse(
            completion_response(rid, ing.model_name, seqs, ing.tokenizer, want_logprobs, echo)
        )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo = texts if req.echo else None
    return sse_response(
        guarded(_completion_events(ing, rid, streams, seqs, want_logprobs, include_usage, echo), http)
    )


async def _completion_events(
    ing: Ingress,
    rid: str,
    streams: list[ReplicaStream],
    seqs: Sequences,
    want_logprobs: bool,
    include_usage: bool,
    echo: list[str] | None,
) -> AsyncIterator[str]:
    created, model, offsets = now(), ing.model_name, {}
    async for k, chunk in merged(streams):
        i = seqs.add(k, chunk)
        if i not in offsets:
            offsets[i] = 0
            if echo:
                yield sse(completion_chunk(rid, created, model, i, echo[k]))
        if chunk.text or (want_logprobs and chunk.logprobs):
            lps = None
            if want_logprobs:
                lps = completion_logprobs(ing.tokenizer, chunk.logprobs or [], offsets[i])
                offsets[i] += sum(len(t) for t in lps["tokens"])
            yield sse(completion_chunk(rid, created, model, i, chunk.text, logprobs=lps))
        if chunk.finished:
            s = seqs.choices[i]
            yield sse(
                completion_chunk(rid, created, model, i, "", s.finish_reason, matched_stop=s.matched_stop)
            )
    if include_usage:
        yield sse(usage_chunk(rid, created, model, "text_completion", seqs.usage()))


async def generate(ing: Ingress, req: GenerateHTTPRequest, http: Request) -> Response:
    if (req.text is None) == (req.input_ids is None):
        raise errors.bad_request("give exactly one of 'text' and 'input_ids'", "text")
    if req.text is not None:
        ids = await encode_prompt(ing, req.text, "text")
    else:
        input_ids = req.input_ids
        assert input_ids is not None
        check_prompt_fits(len(input_ids), ing.card.context_length, "input_ids")
        ing.tokenizer.check_ids(input_ids, "input_ids")
        ids = list(input_ids)
    if not ids:
        raise errors.bad_request("the prompt must not be empty", "text")
    params = native_sampling_params(req, len(ids), ing.card.vocab_size, ing.card.context_length)
    rid = req.rid or new_id("gen")
    streams = await open_streams(ing, _requests([ids], [params], rid, req.stream, identity_of(http)))
    # Logprob triples carry the token's text whenever logprobs are returned (SGLang's
    # return_text_in_logprobs is accepted; the offline Engine fills the text too).
    seqs = Sequences(1, params.n, native_rid=rid, token_text=ing.tokenizer.token_text)
    assert seqs.native is not None
    if not req.stream:
        if not await collect(streams, seqs, http):
            return Response(status_code=499)
        return JSONResponse(seqs.native[0] if params.n == 1 else seqs.native)
    return sse_response(guarded(_native_events(streams, seqs, params.n > 1), http))


async def _native_events(streams: list[ReplicaStream], seqs: Sequences, indexed: bool) -> AsyncIterator[str]:
    """SGLang streams cumulative text and ids: each event is the whole output so far."""
    assert seqs.native is not None
    async for k, chunk in merged(streams):
        i = seqs.add(k, chunk)
        if chunk.token_ids or chunk.text or chunk.finished:
            yield sse(dict(seqs.native[i], index=i) if indexed else seqs.native[i])
