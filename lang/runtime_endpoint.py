"""Programs on a running server over its native API (`/generate`)."""

from __future__ import annotations

from typing import Any

from radixserve.lang.backend import OnDelta
from radixserve.lang.chat_format import ChatFormat, Renderer
from radixserve.lang.http_client import HttpClient
from radixserve.lang.native_backend import NativeBackend


class RuntimeEndpoint(NativeBackend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=...)`.

    Every batch of calls is one `/generate` request (a list of texts, one sampling-params dict
    per text), so a fork's branches are admitted together and their shared prefix is computed
    once even on a cold cache. Role blocks are written as the server's chat template writes
    them (read once, through `/v1/tokenize` and `/v1/detokenize`); `chat_template` (a Hugging
    Face tokenizer, or any `render(messages, add_generation_prompt) -> str`) renders them on
    this side instead."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template: Any = None,
        timeout_s: float = 600.0,
    ):
        self.http = HttpClient(base_url, api_key, timeout_s)
        self._renderer = _renderer(chat_template)
        self._format: ChatFormat | None = None

    def chat_format(self) -> ChatFormat:
        if self._format is None:
            self._format = ChatFormat.from_renderer(self._renderer or self._render_on_server)
        return self._format

    def _render_on_server(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The chat as the server's template writes it: its ids, decoded with their special
        tokens (which a /generate text spells back into the same ids)."""
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        ids = self.http.post("/v1/tokenize", body)["tokens"]
        return str(self.http.post("/v1/detokenize", {"tokens": ids})["text"])

    def server_info(self) -> dict[str, Any]:
        return dict(self.http.get("/get_server_info"))

    def flush_cache(self) -> None:
        self.http.post("/flush_cache", {})

    def native(
        self,
        texts: list[str],
        params: list[dict[str, Any]],
        logprob_start_len: int | None = None,
        on_delta: OnDelta | None = None,
    ) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"text": list(texts), "sampling_params": list(params)}
        if logprob_start_len is not None:
            body.update(return_logprob=True, logprob_start_len=logprob_start_len)
        if on_delta is None:
            return list(self.http.post("/generate", body))
        outs: list[dict[str, Any]] = [{"text": ""} for _ in texts]
        for event in self.http.events("/generate", dict(body, stream=True)):
            i = int(event["index"])
            if len(event["text"]) > len(outs[i]["text"]):
                on_delta(i, event["text"][len(outs[i]["text"]) :])
            outs[i] = event
        return outs


def _renderer(template: Any) -> Renderer | None:
    if template is None:
        return None
    if not hasattr(template, "apply_chat_template"):
        return template  # a render function
    return lambda msgs, gen: str(
        template.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    )
