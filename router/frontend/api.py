"""The FastAPI app: OpenAI routes, SGLang's native routes, and the guards in front of them.

Who may call what (router/frontend/tenants.py holds the keys): /health and /ready need no key; the admin
routes (ADMIN_ROUTES: /flush_cache, /load_lora_adapter, /unload_lora_adapter) need the admin key, or the single `api_key` when no admin key
is set; every other route takes any valid key. /metrics and /get_server_info stay open to every
tenant: they report totals over all tenants (counters, sizes, loads), never a prompt, a request
id or a per-tenant figure, and key settings show masked. /abort_request aborts only the caller's
own requests (another tenant's id gets the answer an unknown id gets).

Bodies are parsed by hand (`model_validate_json`) rather than by FastAPI's parameter binding, so
every malformed or invalid body is a 400 in OpenAI's shape; FastAPI's 422 handler is replaced too,
for anything that still reaches it. Whatever a route raises is mapped by `errors.from_exception`
(in `ContainErrors`): internals never reach a client.

Shutdown: once the ingress drains (`Ingress.drain`, which `radixserve serve` calls when it is
stopped), every route but /health, /metrics and /get_server_info answers 503 `shutting_down`,
/ready included, while the requests already in flight finish.

Health: `/health` is the HTTP server's liveness (200 while this process serves). Readiness means
an engine can serve: `/ready` asks every engine replica for its stats and is 200 when at least one
answers; `/health_generate` (SGLang's) runs a real one-token generation. Both answer 503 when no
engine does so within their timeout.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection

from radixserve.router.frontend import errors, serving
from radixserve.router.frontend.responses import Sequences
from radixserve.router.frontend.schemas import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateHTTPRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
)
from radixserve.router.frontend.tenants import ADMIN_ROUTES, IDENTITY, ApiKeys, identity_of
from radixserve.workers.protocol import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from radixserve.router.frontend.ingress import Ingress

AUTH_EXEMPT = frozenset({"/health", "/ready"})
DRAIN_EXEMPT = frozenset({"/health", "/metrics", "/get_server_info"})
VERSION = importlib.metadata.version("radixserve")
READY_TIMEOUT_S = 5.0  # an engine replica that cannot report its stats in this time is not ready
HEALTH_GENERATE_TIMEOUT_S = 20.0  # a one-token generation behind a busy queue may take a while


class Guard:
    """ASGI middleware, before any parsing: the caller's identity from its API key (401 for a
    wrong one, 403 on an admin route without admin rights), put in the scope's state for the
    handlers (`identity_of`); then the body size."""

    def __init__(self, app: Any, keys: ApiKeys, max_bytes: int):
        self.app = app
        self.keys = keys
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if scope["path"] not in AUTH_EXEMPT:
            identity = self.keys.identify(headers.get("authorization", b""))
            if identity is None:
                return await errors.unauthorized().response()(scope, receive, send)
            if scope["path"] in ADMIN_ROUTES and not identity.admin:
                return await errors.forbidden().response()(scope, receive, send)
            scope.setdefault("state", {})[IDENTITY] = identity
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await errors.too_large(self.max_bytes).response()(scope, receive, send)
        seen = 0

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # a chunked body with no Content-Length
                raise errors.too_large(self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)


class Drain:
    """ASGI middleware: counts the HTTP requests in flight on the ingress; once it drains (the
    server is stopping), answers new ones with 503 `shutting_down`, except DRAIN_EXEMPT routes
    (liveness, and the figures an operator watches a drain with)."""

    def __init__(self, app: Any, ing: Ingress):
        self.app = app
        self.ing = ing

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.ing.draining and scope["path"] not in DRAIN_EXEMPT:
            return await errors.shutting_down().response()(scope, receive, send)
        self.ing.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.ing.in_flight -= 1


class ContainErrors:
    """ASGI middleware: whatever a route raises becomes the client's error here, once. (Starlette's
    own last-resort handler re-raises after answering, and Serve would then answer again with
    the exception's text.) After a response started, the stream's own in-band error has been
    sent, so the exception is only logged."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            rid = errors.request_id(HTTPConnection(scope))
            error = errors.from_exception(exc, rid)
            if not started:
                await error.response()(scope, receive, send)


async def parse(request: Request, schema: type[BaseModel]) -> Any:
    return schema.model_validate_json(await request.body())


def add_error_handlers(app: FastAPI) -> None:
    """Errors raised outside a route's own handling (routing, FastAPI's validation)."""

    async def api_error(request: Request, exc: Exception) -> Response:
        return errors.from_exception(exc, errors.request_id(request)).response()

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return errors.from_validation_errors(list(exc.errors())).response()

    app.add_exception_handler(errors.APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return errors.not_found(request.url.path).response()
        if exc.status_code == 405:
            return errors.method_not_allowed(request.method, request.url.path).response()
        return errors.APIError(exc.status_code, str(exc.detail)).response()

    app.add_exception_handler(StarletteHTTPException, http_error)


def build_api(ing: Ingress) -> FastAPI:
    app = FastAPI(title="RadixServe", version=VERSION, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, keys=ing.http.api_keys(), max_bytes=ing.http.max_request_bytes)
    app.add_middleware(Drain, ing=ing)
    app.add_middleware(ContainErrors)  # outermost: it also sees what the Guard raises
    add_error_handlers(app)
    started = int(time.time())

    def post(
        path: str, schema: type[BaseModel], fn: Callable[[Ingress, Any, Request], Awaitable[Response]]
    ) -> None:
        async def route(request: Request) -> Response:
            return await fn(ing, await parse(request, schema), request)

        app.add_api_route(path, route, methods=["POST"])

    post("/v1/chat/completions", ChatCompletionRequest, serving.chat)
    post("/v1/completions", CompletionRequest, serving.completions)
    post("/generate", GenerateHTTPRequest, serving.generate)
    post("/v1/tokenize", TokenizeRequest, tokenize)
    post("/v1/detokenize", DetokenizeRequest, detokenize)
    post("/abort_request", AbortRequest, abort_request)

    def model_card() -> dict[str, Any]:
        return {
            "id": ing.model_name,
            "object": "model",
            "created": started,
            "owned_by": "radixserve",
            "root": ing.card.model_path,
            "max_model_len": ing.card.context_length,
        }

    def adapter_card(name: str, path: str) -> dict[str, Any]:
        return {**model_card(), "id": name, "root": path, "parent": ing.model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = [adapter_card(n, p) for n, p in sorted(ing.loras.items())]
        return {"object": "list", "data": [model_card(), *adapters]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        lora = await serving.resolve_model(ing, model)
        return model_card() if lora is None else adapter_card(lora.name, lora.path)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = await parse(request, LoadLoRARequest)
        if not ing.config.lora_enabled:
            raise errors.bad_request(
                "this server runs no LoRA adapters (start it with --enable-lora)", "lora_name"
            )
        if req.lora_name == ing.model_name:
            raise errors.bad_request("an adapter cannot take the base model's name", "lora_name")
        refusal = await ing.load_lora(req.lora_name, req.lora_path)
        if refusal is not None:
            raise errors.bad_request(refusal, "lora_path")
        return JSONResponse({"success": True, "message": f"LoRA adapter {req.lora_name!r} loaded."})

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = await parse(request, UnloadLoRARequest)
        if not await ing.unload_lora(req.lora_name):
            raise errors.model_not_found(req.lora_name)
        return JSONResponse({"success": True, "message": f"LoRA adapter {req.lora_name!r} unloaded."})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        try:
            replicas = len(await ing.replica_stats(timeout_s=READY_TIMEOUT_S))
        except Exception as e:  # a timeout, or Serve finding no replica to ask
            errors.logger.warning("readiness check: %r", e)
            replicas = 0
        if not replicas:
            return errors.not_ready("no engine replica answered").response()
        return JSONResponse({"status": "ready", "engine_replicas": replicas})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        req = GenerateRequest(
            input_ids=ing.tokenizer.encode("ping", add_special_tokens=True),
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"health-{time.monotonic_ns()}",
        )
        seqs = Sequences(1, 1)

        async def one_token() -> bool:
            return await serving.collect([await ing.open(req)], seqs, request)

        try:
            ok = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return errors.not_ready(f"no generation within {HEALTH_GENERATE_TIMEOUT_S:g}s").response()
        except Exception as e:
            errors.logger.warning("health generation %s failed: %r", req.rid, e)
            return errors.not_ready("the generation failed").response()
        if not (ok and seqs.done):
            return errors.not_ready("the generation did not finish").response()
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        c = ing.card
        return {
            "model_path": c.model_path,
            "served_model_name": c.served_model_name,
            "is_generation": True,
            "context_length": c.context_length,
            "vocab_size": c.vocab_size,
            "eos_token_ids": c.eos_token_ids,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        replicas = [s.to_dict() for s in await ing.replica_stats()]
        return {
            **ing.config.server_info(),
            "version": VERSION,
            "served_model_name": ing.model_name,
            "context_length": ing.card.context_length,
            "replicas": replicas,
            "router": ing.router_snapshot(),
            "transport": ing.transport,
        }

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        ok = await ing.flush_cache()
        return JSONResponse(
            {
                "success": ok,
                "message": "Cache flushed." if ok else "Cache not flushed: requests are running.",
            },
            status_code=200 if ok else 400,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        ing.metrics.set_replicas(await ing.replica_stats())
        ing.metrics.set_router(ing.router_snapshot())
        return Response(ing.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def tokenize(ing: Ingress, req: TokenizeRequest, http: Request) -> Response:
    await serving.resolve_model(ing, req.model)  # an adapter shares the base model's tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise errors.bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    for name in ("tools", "chat_template_kwargs", "add_generation_prompt"):
        if req.prompt is not None and name in req.model_fields_set:
            raise errors.bad_request(f"'{name}' applies to 'messages' only", name)
    if req.messages is not None and "add_special_tokens" in req.model_fields_set:
        raise errors.bad_request(
            "'add_special_tokens' applies to 'prompt' only (the chat template writes its own)",
            "add_special_tokens",
        )
    pool, tok = ing.tokenizer_pool, ing.tokenizer
    if req.prompt is not None:
        ids = await pool.run(len(req.prompt), tok.encode, req.prompt, req.add_special_tokens, "prompt")
    else:
        chat = ChatCompletionRequest.model_construct(
            messages=req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs
        )
        _, ids = await serving.chat_prompt(ing, chat, False, req.add_generation_prompt)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ing.card.context_length})


async def detokenize(ing: Ingress, req: DetokenizeRequest, http: Request) -> Response:
    await serving.resolve_model(ing, req.model)
    return JSONResponse(
        {"text": await ing.tokenizer_pool.run(len(req.tokens), ing.tokenizer.decode, req.tokens)}
    )


async def abort_request(ing: Ingress, req: AbortRequest, http: Request) -> Response:
    aborted = await ing.abort(identity_of(http).engine_rid(req.rid))
    return JSONResponse({"rid": req.rid, "aborted": aborted})
