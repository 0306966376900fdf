"""The generation endpoints' logic: OpenAI chat and completions, SGLang's native /generate.

Each handler validates and tokenizes, opens one replica stream per prompt (so a refusal becomes
an HTTP status before any byte is sent), then either streams SSE or collects a JSON body. A client
that goes away cancels its streams, which aborts the requests in their replicas.

Text prompts are tokenized on the ingress's tokenizer threads, after a check that needs no
tokenizing: a prompt whose length alone proves it longer than the context is refused at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.router.frontend import errors
from radixserve.router.frontend.reasoning import ReasoningSplit, thinking_of
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
    prompt_logprobs,
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
    native_sampling_dicts,
    native_sampling_params,
)
from radixserve.router.frontend.tenants import Identity, identity_of
from radixserve.router.frontend.tool_parsers import infer_parser, parser_class
from radixserve.router.frontend.tool_requests import ToolPlan, plan_tools, template_knows_tools
from radixserve.workers.protocol import (
    REASONING_FORMATS,
    GenerateRequest,
    InvalidRequest,
    LoRARef,
    OutputChunk,
    SamplingParams,
    part_rid,
)

if TYPE_CHECKING:
    from radixserve.router.frontend.ingress import Ingress, Stream

_DONE = object()


async def resolve_model(ing: Ingress, model: str | None) -> LoRARef | None:
    """The LoRA adapter a request's `model` names (None: the base model); an unknown name is a
    404 model_not_found."""
    if model is None or model == ing.model_name:
        return None
    path = await ing.lora(model)
    if path is None:
        raise errors.model_not_found(model)
    return LoRARef(model, path)


async def resolve_lora_name(ing: Ingress, name: str) -> LoRARef:
    """/generate's `lora_path`: a loaded adapter's name (404 model_not_found otherwise)."""
    path = await ing.lora(name)
    if path is None:
        raise errors.APIError(
            404, f"The LoRA adapter `{name}` does not exist.", param="lora_path", code="model_not_found"
        )
    return LoRARef(name, path)


def served_name(ing: Ingress, lora: LoRARef | None) -> str:
    """The `model` a response names: the adapter's, or the base model's."""
    return ing.model_name if lora is None else lora.name


async def open_streams(ing: Ingress, reqs: list[GenerateRequest]) -> list[Stream]:
    """Open every prompt's stream, or none: a refusal cancels the ones already admitted."""
    streams: list[Stream] = []
    try:
        for req in reqs:
            streams.append(await ing.open(req))
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return streams


async def merged(streams: list[Stream]) -> AsyncIterator[tuple[int, OutputChunk]]:
    """(prompt index, chunk) from all streams as they arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: Stream) -> None:
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


async def collect(streams: list[Stream], seqs: Sequences, http: Request) -> bool:
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


async def encode_chat(
    ing: Ingress,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    must_fit: bool = True,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The chat's ids, templated on a tokenizer thread; refused unread if it must fit the
    context and cannot (counting alone, /v1/tokenize, takes any length the body limit let in)."""
    size = sum(len(m["content"]) for m in messages)
    if must_fit:
        check_prompt_fits(ing.tokenizer.min_tokens(size), ing.card.context_length, "messages")
    encode = ing.tokenizer.encode_chat
    return await ing.tokenizer_pool.run(size, encode, messages, template_kwargs, tools, add_generation_prompt)


def reasoning_splits(ing: Ingress) -> Callable[[], ReasoningSplit] | None:
    """A factory of each chat choice's reasoning split, when the server has a reasoning parser."""
    name = ing.http.reasoning_parser
    if name is None:
        return None
    fmt, token_text = REASONING_FORMATS[name], ing.tokenizer.token_text
    return lambda: ReasoningSplit(fmt, token_text)


def _requests(
    ids_list: list[list[int]],
    params: list[SamplingParams],
    rid: str,
    stream: bool,
    who: Identity,
    lora: LoRARef | None = None,
) -> list[GenerateRequest]:
    """One request per prompt, in the caller's cache namespace and request-id space."""
    many = len(ids_list) > 1
    return [
        GenerateRequest(
            input_ids=ids,
            sampling_params=p,
            rid=who.engine_rid(part_rid(rid, k) if many else rid),
            namespace=who.namespace,
            stream=stream,
            lora=lora,
        )
        for k, (ids, p) in enumerate(zip(ids_list, params))
    ]


def _plan_tools(ing: Ingress, req: ChatCompletionRequest) -> tuple[ToolPlan | None, list[dict[str, Any]]]:
    """The request's tools checked and its messages as the template takes them (on a tokenizer
    thread: tool schemas can be large)."""
    template = getattr(ing.tokenizer.hf, "chat_template", None)
    template = template if isinstance(template, str) else None
    family = ing.http.tool_call_parser or infer_parser(template)
    return plan_tools(req, family, template_knows_tools(template), ing.tokenizer.chat.special_ids)


def _tool_overrides(ing: Ingress, plan: ToolPlan | None) -> dict[str, Any]:
    """Sampling parameters the tools decide: their grammar, and special tokens kept in the text
    when the family's call markers are special tokens (they would be dropped otherwise)."""
    if plan is None or plan.family is None:
        return {}
    out: dict[str, Any] = {}
    if plan.grammar is not None:
        out["structural_tag"] = plan.grammar
    markers = parser_class(plan.family).markers
    if any(m in ing.tokenizer.chat.special_ids for m in markers):
        out["skip_special_tokens"] = False
    return out


async def chat_prompt(
    ing: Ingress, req: ChatCompletionRequest, must_fit: bool = True, add_generation_prompt: bool = True
) -> tuple[ToolPlan | None, list[int]]:
    """The request's tool plan and its prompt ids: the history, the tools and the template's
    variables rendered by the model's chat template."""
    size = sum(len(m.text()) for m in req.messages)
    if req.tools is None and not any(m.tool_calls for m in req.messages):
        plan, messages = _plan_tools(ing, req)  # no schema nor arguments to read: O(messages)
    else:
        plan, messages = await ing.tokenizer_pool.run(size, _plan_tools, ing, req)
    tools = plan.tools if plan else None
    ids = await encode_chat(ing, messages, req.chat_template_kwargs, tools, must_fit, add_generation_prompt)
    return plan, ids


async def chat(ing: Ingress, req: ChatCompletionRequest, http: Request) -> Response:
    lora = await resolve_model(ing, req.model)
    check_sequences(1, req.n)
    plan, ids = await chat_prompt(ing, req)
    params = chat_sampling_params(
        req,
        len(ids),
        ing.card.vocab_size,
        ing.card.context_length,
        overrides=_tool_overrides(ing, plan),
        reasoning=thinking_of(ing.http.reasoning_parser, req.chat_template_kwargs),
    )
    rid = req.rid or new_id("chatcmpl")
    try:
        streams = await open_streams(
            ing, _requests([ids], [params], rid, req.stream, identity_of(http), lora)
        )
    except InvalidRequest as e:  # the tools' grammar, refused by the replica that compiled it
        if e.param == "structural_tag" and plan is not None:
            raise InvalidRequest(e.message, "tools", e.code) from None
        raise
    seqs = Sequences(1, params.n, reasoning=reasoning_splits(ing), tools=plan.parser if plan else None)
    if not req.stream:
        if not await collect(streams, seqs, http):
            return Response(status_code=499)
        return JSONResponse(chat_response(rid, served_name(ing, lora), seqs, ing.tokenizer, req.logprobs))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    events = _chat_events(ing, served_name(ing, lora), rid, streams, seqs, req.logprobs, include_usage)
    return sse_response(guarded(events, http))


async def _chat_events(
    ing: Ingress,
    model: str,
    rid: str,
    streams: list[Stream],
    seqs: Sequences,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    created, started = now(), set()
    async for k, chunk in merged(streams):
        i = seqs.add(k, chunk)
        if i not in started:
            started.add(i)
            yield sse(chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}))
        delta = seqs.choices[i].last_delta
        if delta or (want_logprobs and chunk.logprobs):
            lps = chat_logprobs(ing.tokenizer, chunk.logprobs or []) if want_logprobs else None
            yield sse(chat_chunk(rid, created, model, i, delta or {"content": ""}, logprobs=lps))
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
    lora = await resolve_model(ing, req.model)
    ids_list, texts = await _prompts(ing, req.prompt, req.n)
    card = ing.card
    params = [
        completion_sampling_params(req, len(ids), card.vocab_size, card.context_length) for ids in ids_list
    ]
    rid = req.rid or new_id("cmpl")
    streams = await open_streams(ing, _requests(ids_list, params, rid, req.stream, identity_of(http), lora))
    seqs = Sequences(len(ids_list), req.n)
    want_logprobs = req.logprobs is not None
    if not req.stream:
        if not await collect(streams, seqs, http):
            return Response(status_code=499)
        echo = texts if req.echo else None
        return JSONResponse(
            completion_response(
                rid, served_name(ing, lora), seqs, ing.tokenizer, want_logprobs, echo, ids_list
            )
        )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    prompts = (texts, ids_list) if req.echo else None
    return sse_response(
        guarded(
            _completion_events(
                ing, served_name(ing, lora), rid, streams, seqs, want_logprobs, include_usage, prompts
            ),
            http,
        )
    )


async def _completion_events(
    ing: Ingress,
    model: str,
    rid: str,
    streams: list[Stream],
    seqs: Sequences,
    want_logprobs: bool,
    include_usage: bool,
    echo: tuple[list[str], list[list[int]]] | None,
) -> AsyncIterator[str]:
    """`echo`: each prompt's text and ids; its text (and logprobs) open each of its choices."""
    created, offsets = now(), {}
    async for k, chunk in merged(streams):
        i = seqs.add(k, chunk)
        if i not in offsets:
            offsets[i] = 0
            if echo:
                texts, ids_list = echo
                lps = None
                if want_logprobs and chunk.input_logprobs is not None:
                    lps = prompt_logprobs(ing.tokenizer, ids_list[k], chunk.input_logprobs)
                yield sse(completion_chunk(rid, created, model, i, texts[k], logprobs=lps))
                offsets[i] = len(texts[k])
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
    """One prompt gives one result (a list of n with n > 1); a batch gives the list of every
    prompt's results in order (n each), its stream events numbered by `index`."""
    ids_list, batched = await _native_prompts(ing, req)
    params = [
        native_sampling_params(req, given, len(ids), ing.card.vocab_size, ing.card.context_length)
        for given, ids in zip(native_sampling_dicts(req, len(ids_list)), ids_list)
    ]
    n = params[0].n
    if any(p.n != n for p in params):
        raise errors.bad_request("every prompt of a batch must ask for the same 'n'", "sampling_params")
    check_sequences(len(ids_list), n)
    rid = req.rid or new_id("gen")
    lora = None if req.lora_path is None else await resolve_lora_name(ing, req.lora_path)
    streams = await open_streams(ing, _requests(ids_list, params, rid, req.stream, identity_of(http), lora))
    token_text = ing.tokenizer.token_text if req.return_text_in_logprobs else None
    seqs = Sequences(len(ids_list), n, native_rid=rid, token_text=token_text, prompt_ids=ids_list)
    assert seqs.native is not None
    indexed = batched or n > 1
    if not req.stream:
        if not await collect(streams, seqs, http):
            return Response(status_code=499)
        return JSONResponse(seqs.native if indexed else seqs.native[0])
    return sse_response(guarded(_native_events(streams, seqs, indexed), http))


async def _native_prompts(ing: Ingress, req: GenerateHTTPRequest) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether they came as a batch (a list)."""
    if (req.text is None) == (req.input_ids is None):
        raise errors.bad_request("give exactly one of 'text' and 'input_ids'", "text")
    if req.text is not None:
        batched = isinstance(req.text, list)
        texts = req.text if isinstance(req.text, list) else [req.text]
        _check_batch_size(len(texts), "text")
        ids_list = [await encode_prompt(ing, text, "text") for text in texts]
    else:
        given = req.input_ids
        assert given is not None
        batched = bool(given) and isinstance(given[0], list)
        raw: list = given if batched else [given]
        _check_batch_size(len(raw), "input_ids")
        ids_list = []
        for ids in raw:
            check_prompt_fits(len(ids), ing.card.context_length, "input_ids")
            ing.tokenizer.check_ids(ids, "input_ids")
            ids_list.append(list(ids))
    if any(not ids for ids in ids_list):
        raise errors.bad_request(
            "the prompt must not be empty", "text" if req.text is not None else "input_ids"
        )
    return ids_list, batched


def _check_batch_size(num_prompts: int, param: str) -> None:
    if num_prompts == 0:
        raise errors.bad_request(f"'{param}' must hold at least one prompt", param)
    check_sequences(num_prompts, 1)


async def _native_events(streams: list[Stream], seqs: Sequences, indexed: bool) -> AsyncIterator[str]:
    """SGLang streams cumulative text and ids: each event is the whole output so far."""
    assert seqs.native is not None
    async for k, chunk in merged(streams):
        i = seqs.add(k, chunk)
        if chunk.token_ids or chunk.text or chunk.finished:
            yield sse(dict(seqs.native[i], index=i) if indexed else seqs.native[i])
