"""Programs on an offline `Engine` in this process: the same native batches, no HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

from radixserve.lang.backend import OnDelta
from radixserve.lang.chat_format import ChatFormat
from radixserve.lang.errors import BackendError
from radixserve.lang.native_backend import NativeBackend
from radixserve.workers import Engine
from radixserve.workers.protocol import EngineError, InvalidRequest, QueueFull


class EngineBackend(NativeBackend):
    """`EngineBackend(Engine())`. The engine's own refusals become BackendError (400 for a bad
    request, 429 for a full queue, 500 for an engine failure) with the engine's message."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._format: ChatFormat | None = None

    @classmethod
    def start(cls, model_path: str | None = None, **engine_args: Any) -> EngineBackend:
        """A backend over a new Engine (`Engine(model_path, **engine_args)`); `shutdown()` ends it."""
        return cls(Engine(model_path, **engine_args))

    def shutdown(self) -> None:
        self.engine.shutdown()

    def chat_format(self) -> ChatFormat:
        if self._format is None:
            tok = self.engine.tokenizer
            if not getattr(tok, "chat_template", None):
                return super().chat_format()
            self._format = ChatFormat.from_renderer(
                lambda msgs, gen: str(
                    tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                )
            )
        return self._format

    def native(
        self,
        texts: list[str],
        params: list[dict[str, Any]],
        logprob_start_len: int | None = None,
        on_delta: OnDelta | None = None,
    ) -> list[dict[str, Any]]:
        if logprob_start_len is not None:
            params = [dict(p, logprobs=True, logprob_start_len=logprob_start_len) for p in params]
        try:
            return asyncio.run(self._batch(texts, params, on_delta))
        except InvalidRequest as e:
            raise BackendError(400, str(e), getattr(e, "param", None), "invalid_request_error") from None
        except QueueFull as e:
            raise BackendError(429, str(e)) from None
        except EngineError as e:
            raise BackendError(500, str(e)) from None

    async def _batch(
        self, texts: list[str], params: list[dict[str, Any]], on_delta: OnDelta | None
    ) -> list[dict[str, Any]]:
        if on_delta is None:
            out = await self.engine.async_generate(list(texts), list(params))
            return list(out)

        async def one(i: int) -> dict[str, Any]:
            last: dict[str, Any] = {"text": ""}
            async for result in await self.engine.async_generate(texts[i], params[i], stream=True):
                if len(result["text"]) > len(last["text"]):
                    on_delta(i, result["text"][len(last["text"]) :])
                last = result
            return last

        return list(await asyncio.gather(*(one(i) for i in range(len(texts)))))
