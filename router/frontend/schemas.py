"""HTTP request schemas (OpenAI + SGLang native) and their translation into `SamplingParams`.

Schemas are strict (no string-to-number coercion) and closed (an unknown argument is a 400, as
OpenAI does); parameters that OpenAI clients commonly send but that change nothing here (`user`,
`store`, `metadata` ...) are accepted and ignored. Range checks live in one place,
`SamplingParams.validate`, so the native API and the OpenAI API reject exactly the same values.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.workers.protocol import (
    MAX_SEQUENCES_PER_REQUEST,
    InvalidRequest,
    SamplingParams,
    check_context_length,
    check_logprob_start_len,
    parse_logit_bias,
)

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API


# A client's request id: printable (no control characters, so it can carry no log line break
# and never contains `protocol.ATTEMPT_SEP`) and bounded.
RequestId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Schema):
    include_usage: bool = False


class ContentPart(_Schema):
    type: Literal["text"]
    text: str


class FunctionCall(_Schema):
    name: str
    arguments: str  # JSON text of an object


class MessageToolCall(_Schema):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[MessageToolCall] | None = None  # an assistant message: the calls it made

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JSONSchemaFormat(_Schema):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class FunctionDefinition(_Schema):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None


class ToolDefinition(_Schema):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Schema):
    name: str


class NamedToolChoice(_Schema):
    type: Literal["function"]
    function: FunctionName


class ResponseFormat(_Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Schema):
    """Parameters shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted for compatibility; they change nothing here.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # SGLang / vLLM extensions (the OpenAI SDK sends them through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    rid: RequestId | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Extra variables of the chat template (`{"enable_thinking": false}`); chat_template.py
    # refuses those that would replace its own.
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class GenerateHTTPRequest(_Schema):
    """SGLang's native /generate: one prompt (text or ids) or a batch (a list of texts, or of
    token-id lists), with SGLang-named sampling params: one dict for all, or one per prompt."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    # With return_logprob, the prompt's logprobs too, from this position on (SGLang's default -1:
    # the output tokens' only).
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # SGLang's switch for token text in logprob triples (False: text None). True by default here:
    # the text was always there before the switch was honoured.
    return_text_in_logprobs: bool = True
    rid: RequestId | None = None
    lora_path: str | None = None  # the name of a loaded LoRA adapter (SGLang's field); None: the base


class TokenizeRequest(_Schema):
    model: str | None = None
    prompt: str | None = None
    # A chat is rendered as /v1/chat/completions renders it: tool calls and results in the
    # history, the tool definitions and the template's variables all count.
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # what a chat request generates after (messages only)
    add_special_tokens: bool = True  # a prompt's BOS (prompt only)


class DetokenizeRequest(_Schema):
    model: str | None = None
    tokens: list[int]


class AbortRequest(_Schema):
    rid: RequestId


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _common(req: _SamplingFields) -> dict[str, Any]:
    d: dict[str, Any] = {
        "n": req.n,
        "stop": _stop_list(req.stop),
        "ignore_eos": req.ignore_eos,
        "min_new_tokens": req.min_tokens,
        "seed": req.seed,
        "skip_special_tokens": req.skip_special_tokens,
        "regex": req.regex,
        "ebnf": req.ebnf,
        "json_schema": req.json_schema,
    }
    for name in (
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
    ):
        if getattr(req, name) is not None:
            d[name] = getattr(req, name)
    if req.logit_bias is not None:
        d["logit_bias"] = parse_logit_bias(req.logit_bias)
    return d


def check_sequences(num_prompts: int, n: int) -> None:
    """Every prompt times n is a sequence the engine schedules; one request gets a bounded number."""
    if num_prompts * n > MAX_SEQUENCES_PER_REQUEST:
        raise InvalidRequest(
            f"This request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
            f"at most {MAX_SEQUENCES_PER_REQUEST} are allowed per request. Send fewer prompts or a "
            "smaller n, or split the batch into several requests.",
            "n" if num_prompts == 1 else "prompt",
        )


def check_prompt_fits(min_prompt_tokens: int, context_length: int, param: str) -> None:
    """Refuse a prompt known to be at least `min_prompt_tokens` long if that leaves no room for
    one completion token: the context-length rule, decided before tokenizing."""
    check_context_length(min_prompt_tokens, 1, context_length, param, prompt_at_least=True)


def max_new_tokens(requested: int | None, prompt_len: int, context_length: int, param: str) -> int:
    """The completion budget: as requested, or the rest of the context; 400 when it cannot fit."""
    if requested is not None and (isinstance(requested, bool) or requested < 1):
        raise InvalidRequest(f"'{param}' must be >= 1", param)
    budget = requested if requested is not None else context_length - prompt_len
    check_context_length(prompt_len, max(budget, 1), context_length, param)
    return budget


def chat_sampling_params(
    req: ChatCompletionRequest,
    prompt_len: int,
    vocab_size: int,
    context_length: int,
    overrides: dict[str, Any] | None = None,
    reasoning: str | None = None,
) -> SamplingParams:
    """`overrides` are set last: what the request's tools decide (their grammar, special tokens).
    `reasoning` (the server's reasoning parser) makes a grammar constrain only the answer."""
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise InvalidRequest(
            "give either 'max_tokens' or 'max_completion_tokens', not both", "max_completion_tokens"
        )
    limit, param = (
        (req.max_completion_tokens, "max_completion_tokens")
        if req.max_completion_tokens is not None
        else (req.max_tokens, "max_tokens")
    )
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    d = _common(req)
    d["max_new_tokens"] = max_new_tokens(limit, prompt_len, context_length, param)
    d["logprobs"] = req.logprobs
    d["top_logprobs"] = req.top_logprobs or 0
    d["reasoning"] = reasoning
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" and req.json_schema is not None:
        raise InvalidRequest("give either 'response_format' or 'json_schema', not both", "json_schema")
    if fmt is not None and fmt.type == "json_object":
        d["json_schema"] = json.dumps({"type": "object"})
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequest(
                "'response_format.json_schema.schema' is required", "response_format.json_schema"
            )
        d["json_schema"] = json.dumps(fmt.json_schema.schema_)
    d.update(overrides or {})
    return SamplingParams.from_dict(d, vocab_size)


def completion_sampling_params(
    req: CompletionRequest, prompt_len: int, vocab_size: int, context_length: int
) -> SamplingParams:
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("'best_of' other than 'n' is not supported", "best_of")
    if req.suffix is not None:
        raise InvalidRequest("this model does not support infilling: 'suffix' must not be given", "suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequest(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
    d = _common(req)
    d["max_new_tokens"] = max_new_tokens(req.max_tokens, prompt_len, context_length, "max_tokens")
    d["logprobs"] = req.logprobs is not None
    d["top_logprobs"] = req.logprobs or 0
    if req.echo and req.logprobs is not None:
        d["logprob_start_len"] = 0  # the echoed prompt's logprobs come first
    return SamplingParams.from_dict(d, vocab_size)


def native_sampling_dicts(req: GenerateHTTPRequest, num_prompts: int) -> list[dict[str, Any]]:
    """Each prompt's sampling params: the one dict for all, or the list's own (one per prompt)."""
    given = req.sampling_params
    if isinstance(given, dict):
        return [given] * num_prompts
    if len(given) != num_prompts:
        raise InvalidRequest(
            f"'sampling_params' holds {len(given)} entries for {num_prompts} prompt(s): give one "
            "dict for every prompt, or a list of one per prompt",
            "sampling_params",
        )
    return list(given)


def native_sampling_params(
    req: GenerateHTTPRequest, given: dict[str, Any], prompt_len: int, vocab_size: int, context_length: int
) -> SamplingParams:
    """One prompt's parameters: `given` (from `native_sampling_dicts`) and the request's logprob
    fields."""
    d = dict(given)
    d.setdefault("max_new_tokens", SamplingParams.max_new_tokens)
    if req.return_logprob:
        d["logprobs"] = True
        d["top_logprobs"] = req.top_logprobs_num
        if req.logprob_start_len >= 0:
            check_logprob_start_len(req.logprob_start_len, prompt_len)
        d["logprob_start_len"] = req.logprob_start_len
    params = SamplingParams.from_dict(d, vocab_size)
    check_context_length(prompt_len, params.max_new_tokens, context_length, "sampling_params.max_new_tokens")
    return params


class LoadLoRARequest(_Schema):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(_Schema):
    lora_name: str = Field(min_length=1, max_length=256)
