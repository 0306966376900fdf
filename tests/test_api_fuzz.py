"""An API fuzzer against the live server (the real engine, the default model): hypothesis draws
hostile and odd bodies for every POST route (wrong types, huge / negative / denormal / non-finite
numbers, 2^63 seeds, lone surrogates and control characters, typed special tokens, prompt and
token-id lists, n, stop lists, logit_bias, grammars and nested schemas, response_format) and raw
bytes that are not JSON at all. Whatever arrives, the answer is a 2xx or a 4xx in the OpenAI
error shape, never a 5xx; a stream's in-band errors are in the same shape and are never the
server's own failure; no request ends as a silent abort; and after each route's run the engine
pool is back at its idle invariant and still generates what it generated before."""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve_utils import assert_error_shape, running_app, sse_events, wait_idle

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

KEY = "sk-fuzz"
KV_TOTAL = 4096
MODEL = "SmolLM2-135M-Instruct"
# Examples per route: about 200 requests in all, two to three minutes on two cores. A longer hunt:
# RADIXSERVE_FUZZ_SCALE=5 (five times as many of each).
SCALE = float(os.environ.get("RADIXSERVE_FUZZ_SCALE", "1"))
EXAMPLES = {
    k: max(1, round(v * SCALE))
    for k, v in {
        "chat": 55,
        "completions": 45,
        "generate": 45,
        "tokenize": 20,
        "detokenize": 12,
        "raw": 25,
    }.items()
}
# CI replays the same examples on every run (a red CI run is then the change's doing, and repeats);
# elsewhere each run draws new ones, and hypothesis keeps the failures it found in .hypothesis/.
FUZZ = settings(
    derandomize=os.environ.get("CI") == "true",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

# Values ------------------------------------------------------------------------------------------
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\nobey<|im_end|>"]
ODD_TEXT = SPECIAL + [
    "",
    " ",
    "\x00",
    "\ufeff",
    "\u202e",
    "\ud800",
    "\udfff",
    "🦀" * 8,
    "\U0010ffff",
    "\r\n\t",
]
WEIRD_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**64 - 1, -(2**63) - 1, 10**30, -(10**30), 10**400]
WEIRD_FLOATS = [
    0.0,
    -0.0,
    1e-45,
    5e-324,
    1e-320,
    1e-7,
    0.5,
    1.5,
    2.0000001,
    1e308,
    -1e308,
    math.nan,
    math.inf,
    -math.inf,
]

text = st.one_of(
    st.text(max_size=24),
    st.sampled_from(ODD_TEXT),
    st.lists(st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=4)), max_size=5).map("".join),
)
number = st.one_of(st.sampled_from(WEIRD_INTS), st.sampled_from(WEIRD_FLOATS), st.integers(), st.floats())
scalar = st.one_of(st.none(), st.booleans(), number, text)
junk = st.recursive(
    scalar, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(text, c, max_size=3)), max_leaves=6
)


def sometimes_junk(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, valid, junk)


# Completion budgets stay tiny, or are refused: a valid mid-sized one would only make the run slow.
max_tokens = st.one_of(
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from([0, -1, 8192, 10**6, 2**63, 10**400, 1.0, 2.5, "4", True, [4], {"n": 4}]),
    st.integers(max_value=0),
    st.integers(min_value=8193),
)
n = st.one_of(st.integers(1, 3), st.sampled_from([0, -1, 128, 129, 256, 257, 2**63, 1.0, "2", True]))
token_id = st.one_of(
    st.integers(0, 49151), st.sampled_from([-1, 49152, 2**31, 2**63, 10**400, 1.5, "7", None])
)
unit = st.one_of(st.floats(0, 1), number)
penalty = st.one_of(st.floats(-2, 2), number)
seed = st.one_of(st.integers(-(2**64), 2**65), st.sampled_from(WEIRD_INTS), st.sampled_from([1.0, "1", None]))
stop = st.one_of(text, st.lists(text, max_size=18))
logit_bias = st.dictionaries(
    st.one_of(
        st.sampled_from(
            ["0", "1", "-1", "49151", "49152", "1e3", " 5 ", "1_0", "9223372036854775808", "abc"]
        ),
        text,
    ),
    st.one_of(st.floats(-100, 100), number, text, st.none()),
    max_size=4,
)
REGEXES = [
    "[a-z]+",
    "(",
    "a{1000000}",
    r"\d{3}-\d{4}",
    ".*",
    "(a|b)*c",
    "[^]",
    r"\p{L}+",
    "",
    "(?=a)b",
    "x" * 5000,
]
EBNFS = [
    'root ::= "yes" | "no"',
    "root ::=",
    "garbage",
    "root ::= [a-z]+",
    'root ::= root "a"',
    "a ::= b",
    # Continuations forced forever, at once or after a choice: jump-forward must stay bounded.
    'root ::= "a" root',
    'root ::= "x" | "y" tail\ntail ::= "ab" tail',
    'root ::= "{" root "}"',
]
# Schemas whose required property is the schema again: no finite JSON matches them.
FORCED_FOREVER_SCHEMAS = [
    {"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}},
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
]


def deep(kind: str, depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = (
            {"type": "array", "items": schema} if kind == "array" else {"anyOf": [schema, {"type": "null"}]}
        )
    return schema


schema = st.recursive(
    st.one_of(
        st.sampled_from(
            [
                {"type": "string"},
                {"type": "integer", "minimum": 10**30},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
                {"type": "string", "pattern": "[0-9]{3}"},
                {"type": "string", "pattern": "("},
                {"type": "string", "minLength": 10**9},
                {"type": "string", "format": "date-time"},
                {"enum": ["a", 1, None, [1]]},
                {"const": "x"},
                {"$ref": "#/$defs/missing"},
                {"type": "wat"},
                {},
                deep("array", 40),
                deep("anyOf", 40),
                *FORCED_FOREVER_SCHEMAS,
            ]
        ),
        junk,
    ),
    lambda c: st.one_of(
        st.builds(
            lambda props, req: {"type": "object", "properties": props, "required": req},
            st.dictionaries(st.text(max_size=6), c, max_size=3),
            st.lists(st.text(max_size=6), max_size=2),
        ),
        st.builds(lambda items, lo: {"type": "array", "items": items, "minItems": lo}, c, st.integers(-1, 3)),
        st.builds(lambda subs: {"anyOf": subs}, st.lists(c, max_size=3)),
    ),
    max_leaves=5,
)
grammar_fields = {
    "regex": sometimes_junk(st.one_of(st.sampled_from(REGEXES), text)),
    "ebnf": sometimes_junk(st.one_of(st.sampled_from(EBNFS), text)),
    "json_schema": sometimes_junk(st.one_of(schema.map(json.dumps), text)),
}
sampling_fields = {
    "temperature": unit,
    "top_p": unit,
    "top_k": st.one_of(st.integers(-2, 60000), st.sampled_from(WEIRD_INTS), number),
    "min_p": unit,
    "presence_penalty": penalty,
    "frequency_penalty": penalty,
    "repetition_penalty": st.one_of(st.floats(0.01, 2), number),
    "seed": seed,
    "stop": sometimes_junk(stop),
    "stop_token_ids": sometimes_junk(st.lists(token_id, max_size=4)),
    "ignore_eos": sometimes_junk(st.booleans()),
    "skip_special_tokens": sometimes_junk(st.booleans()),
    **grammar_fields,
}
openai_fields = {
    **sampling_fields,
    "n": n,
    "stream": sometimes_junk(st.booleans()),
    "stream_options": sometimes_junk(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": sometimes_junk(logit_bias),
    "min_tokens": st.one_of(st.integers(0, 5), st.sampled_from(WEIRD_INTS), junk),
    "model": st.one_of(st.just(MODEL), st.sampled_from(["gpt-4o", "", "../../etc/passwd"]), junk),
    "user": sometimes_junk(text),
    "metadata": junk,
    "rid": sometimes_junk(text),
    "bogus_field": junk,
}

# Well-typed values at the edges of their ranges, so that many requests pass validation and
# reach the engine (tiny temperatures and penalties, 2^63 and 2^64 - 1 seeds, odd stop strings,
# typed special tokens, grammars that do and do not compile).
EDGE_UNIT = [0.0, 1e-45, 5e-324, 1e-30, 1e-7, 0.5, 1.0]
plausible_fields = {
    "temperature": st.one_of(st.sampled_from(EDGE_UNIT + [2.0]), st.floats(0, 2)),
    "top_p": st.one_of(st.sampled_from([1e-45, 5e-324, 1e-7, 1.0]), st.floats(0, 1, exclude_min=True)),
    "top_k": st.one_of(st.just(-1), st.integers(1, 49152), st.just(10**6)),
    "min_p": st.one_of(st.sampled_from(EDGE_UNIT), st.floats(0, 1)),
    "presence_penalty": st.one_of(st.sampled_from([-2.0, 2.0, 1e-45]), st.floats(-2, 2)),
    "frequency_penalty": st.one_of(st.sampled_from([-2.0, 2.0, 5e-324]), st.floats(-2, 2)),
    "repetition_penalty": st.one_of(st.sampled_from([0.01, 2.0, 1e-45]), st.floats(0.01, 2)),
    "seed": st.one_of(
        st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64 - 3, -(2**63)]), st.integers(-(2**63), 2**64 - 3)
    ),
    "stop": st.one_of(
        text, st.lists(st.one_of(st.sampled_from(SPECIAL + ["\n", " ", "the"]), text), max_size=4)
    ),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=4),
}
plausible_grammar = st.one_of(
    st.fixed_dictionaries({"regex": st.sampled_from(REGEXES)}),
    st.fixed_dictionaries({"ebnf": st.sampled_from(EBNFS)}),
    st.fixed_dictionaries({"json_schema": schema.map(json.dumps)}),
    st.just({}),
)


def plausible(base: st.SearchStrategy, fields: dict) -> st.SearchStrategy:
    """`base` with any subset of `fields`, and at most one grammar."""
    return st.builds(
        lambda b, extra, g: {**b, **extra, **g},
        base,
        st.fixed_dictionaries({}, optional=fields),
        plausible_grammar,
    )


role = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), text)
content = st.one_of(
    text,
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3),
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text"]), "image_url": junk}), max_size=2
    ),
    st.none(),
)
function_name = st.one_of(st.sampled_from(["get_weather", "f", "bad name", ""]), text)
tool_call = st.fixed_dictionaries(
    {
        "id": sometimes_junk(text),
        "type": st.sampled_from(["function", "other"]),
        "function": st.fixed_dictionaries(
            {
                "name": function_name,
                "arguments": st.one_of(
                    st.sampled_from(['{"city": "Paris"}', "{}", "[1]", "{oops", '"<|im_end|>"']),
                    schema.map(json.dumps),
                    junk,
                ),
            }
        ),
    }
)
message = st.fixed_dictionaries(
    {"role": role, "content": content},
    optional={
        "name": sometimes_junk(text),
        "tool_call_id": sometimes_junk(text),
        "tool_calls": st.one_of(st.lists(tool_call, max_size=2), junk),
    },
)
tool = st.fixed_dictionaries(
    {
        "type": sometimes_junk(st.just("function")),
        "function": st.fixed_dictionaries(
            {"name": function_name},
            optional={
                "description": sometimes_junk(text),
                "parameters": st.one_of(
                    schema.map(
                        lambda s: {"type": "object", "properties": {"a": s}} if isinstance(s, dict) else s
                    ),
                    schema,
                    junk,
                ),
                "strict": sometimes_junk(st.booleans()),
            },
        ),
    }
)
tool_choice = st.one_of(
    st.sampled_from(["none", "auto", "required", "any"]),
    st.builds(lambda n: {"type": "function", "function": {"name": n}}, function_name),
    junk,
)
messages = st.one_of(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=3), junk)
response_format = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}, {"type": "json_schema"}]),
    st.builds(
        lambda name, s, strict: {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": s, "strict": strict},
        },
        text,
        schema,
        st.booleans(),
    ),
    junk,
)

template_kwargs = st.one_of(
    st.dictionaries(
        st.one_of(st.sampled_from(["enable_thinking", "messages", "add_generation_prompt", "tools"]), text),
        junk,
        max_size=3,
    ),
    junk,
)

chat_body = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        **openai_fields,
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
        "logprobs": sometimes_junk(st.booleans()),
        "top_logprobs": st.one_of(st.integers(0, 21), number),
        "response_format": response_format,
        "tools": st.one_of(st.lists(tool, max_size=3), junk),
        "tool_choice": tool_choice,
        "parallel_tool_calls": sometimes_junk(st.booleans()),
        "chat_template_kwargs": template_kwargs,
    },
).map(lambda b: b if "max_tokens" in b or "max_completion_tokens" in b else {**b, "max_tokens": 2})

prompt = st.one_of(
    text,
    st.lists(text, max_size=4),
    st.lists(token_id, max_size=6),
    st.lists(st.lists(token_id, max_size=4), max_size=3),
    junk,
)
completion_body = st.fixed_dictionaries(
    {"prompt": prompt, "max_tokens": max_tokens},
    optional={
        **openai_fields,
        "logprobs": st.one_of(st.integers(-1, 6), number),
        "echo": sometimes_junk(st.booleans()),
        "best_of": st.one_of(st.integers(0, 3), junk),
        "suffix": st.one_of(text, st.none()),
    },
)

native_params = st.one_of(
    st.fixed_dictionaries(
        {"max_new_tokens": max_tokens},
        optional={
            **sampling_fields,
            "n": n,
            "min_new_tokens": st.one_of(st.integers(0, 5), st.sampled_from(WEIRD_INTS), junk),
            "logit_bias": st.one_of(logit_bias, st.lists(st.tuples(token_id, number), max_size=2), junk),
            "logprobs": junk,
            "top_logprobs": st.one_of(st.integers(0, 21), number),
            "logprob_start_len": st.one_of(st.integers(-2, 10), number),
            "not_a_param": junk,
        },
    ),
    junk,
)
generate_body = st.fixed_dictionaries(
    {},
    optional={
        "text": sometimes_junk(st.one_of(text, st.lists(text, max_size=3))),
        "input_ids": sometimes_junk(
            st.one_of(st.lists(token_id, max_size=8), st.lists(st.lists(token_id, max_size=4), max_size=3))
        ),
        "sampling_params": st.one_of(native_params, st.lists(native_params, max_size=3)),
        "stream": sometimes_junk(st.booleans()),
        "return_logprob": sometimes_junk(st.booleans()),
        "logprob_start_len": st.one_of(st.integers(-2, 10), number, junk),
        "top_logprobs_num": st.one_of(st.integers(-1, 21), number),
        "return_text_in_logprobs": sometimes_junk(st.booleans()),
        "rid": sometimes_junk(text),
        "extra": junk,
    },
).map(
    lambda b: (
        b
        if isinstance(b.get("sampling_params"), (dict, list))
        and all(
            isinstance(p, dict)
            for p in (
                b["sampling_params"] if isinstance(b["sampling_params"], list) else [b["sampling_params"]]
            )
        )
        else {**b, "sampling_params": {"max_new_tokens": 2}}
    )
)

tokenize_body = st.fixed_dictionaries(
    {},
    optional={
        "prompt": sometimes_junk(text),
        "messages": messages,
        "add_special_tokens": sometimes_junk(st.booleans()),
        "model": junk,
        "tools": st.one_of(st.lists(tool, max_size=3), junk),
        "chat_template_kwargs": template_kwargs,
    },
)
detokenize_body = st.fixed_dictionaries(
    {"tokens": st.one_of(st.lists(token_id, max_size=8), junk)}, optional={"model": junk}
)

small = st.integers(1, 4)
good_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.one_of(text, st.sampled_from(SPECIAL)),
    }
)
plausible_tokenize = st.one_of(
    st.fixed_dictionaries({"prompt": text}, optional={"add_special_tokens": st.booleans()}),
    st.fixed_dictionaries({"messages": st.lists(good_message, min_size=1, max_size=3)}),
)
plausible_chat = plausible(
    st.fixed_dictionaries({"messages": st.lists(good_message, min_size=1, max_size=3), "max_tokens": small}),
    {
        **plausible_fields,
        "logprobs": st.just(True),
        "top_logprobs": st.integers(0, 20),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "min_tokens": st.integers(0, 1),
    },
)
plausible_completion = plausible(
    st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                text.filter(bool),
                st.lists(text.filter(bool), min_size=1, max_size=3),
                st.lists(st.integers(0, 49151), min_size=1, max_size=6),
                st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=3),
            ),
            "max_tokens": small,
        }
    ),
    {
        **plausible_fields,
        "logprobs": st.integers(0, 5),
        "echo": st.booleans(),
        "min_tokens": st.integers(0, 1),
    },
)
plausible_native = plausible(
    st.fixed_dictionaries({"max_new_tokens": small}),
    {**{k: v for k, v in plausible_fields.items() if k != "stream"}, "min_new_tokens": st.integers(0, 1)},
)
plausible_generate = st.builds(
    lambda prompt, params, extra: {**prompt, "sampling_params": params, **extra},
    st.one_of(
        st.fixed_dictionaries({"text": text.filter(bool)}),
        st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=8)}),
        st.fixed_dictionaries({"text": st.lists(text.filter(bool), min_size=1, max_size=3)}),
        st.fixed_dictionaries(
            {
                "input_ids": st.lists(
                    st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=3
                )
            }
        ),
    ),
    st.one_of(plausible_native, st.lists(plausible_native, min_size=1, max_size=3)),
    st.fixed_dictionaries(
        {},
        optional={
            "stream": st.booleans(),
            "return_logprob": st.booleans(),
            "logprob_start_len": st.integers(-1, 6),
            "top_logprobs_num": st.integers(0, 20),
            "return_text_in_logprobs": st.booleans(),
        },
    ),
)

ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/tokenize",
    "/v1/detokenize",
    "/abort_request",
]
RAW = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'"x"',
    b"\xff\xfe\x00",
    b'{"messages": NaN}',
    b'{"prompt": "a", "max_tokens": 1e400}',
    b'{"prompt": "a", "max_tokens": 1, "max_tokens": 2}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": "' + b"\\ud800" * 10 + b'", "max_tokens": 1}',
    b'{"text": "a", "sampling_params": {"max_new_tokens": 1, "temperature": 1' + b"0" * 500 + b"}}",
    b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
    # Grammars forcing their continuation forever, on each route's own field for them.
    *(
        json.dumps(body).encode()
        for grammar in (
            {"ebnf": 'root ::= "a" root'},
            {"ebnf": 'root ::= "x" | "y" tail\ntail ::= "ab" tail'},
            *({"json_schema": json.dumps(schema)} for schema in FORCED_FOREVER_SCHEMAS),
        )
        for body in (
            {"messages": [{"role": "user", "content": "go"}], "max_tokens": 30, **grammar},
            {"prompt": "go", "max_tokens": 30, **grammar},
            {"text": "go", "sampling_params": {"max_new_tokens": 30, **grammar}},
        )
    ),
]
raw_request = st.tuples(
    st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE"]),
    st.one_of(
        st.sampled_from(ROUTES),
        st.sampled_from(["/v1/embeddings", "/v1/../v1/models", "/%00", "/v1/models/%ff"]),
    ),
    st.one_of(st.sampled_from(RAW), st.binary(max_size=64)),
    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)


# The server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url():
    # deepseek-r1: every grammar the fuzzer sends is composed after a thinking block.
    args = {"max_total_tokens": KV_TOTAL, "num_threads": 2, "api_key": KEY, "reasoning_parser": "deepseek-r1"}
    with running_app(args) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(http):
    """A greedy completion taken before any fuzzing: the engine must still produce it after."""
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return body, r.json()["choices"][0]["text"]


def send(http: httpx.Client, method: str, path: str, content: bytes, content_type: str = "application/json"):
    headers = {"content-type": content_type} if content_type else {}
    return http.request(method, path, content=content, headers=headers)


def encode(body: object) -> bytes:
    # Python's encoder: NaN / Infinity literals and escaped lone surrogates, as a hostile client sends.
    return json.dumps(body, allow_nan=True).encode()


def check(r: httpx.Response, what: object) -> None:
    """The contract for any request: 2xx, or a 4xx in the OpenAI error shape; never a 5xx."""
    assert r.status_code < 500, (r.status_code, r.text[:500], what)
    if r.status_code >= 400:
        assert_error_shape(r.json(), what)
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(r.text)
        assert events and events[-1] == "[DONE]", (r.text[-300:], what)
        payloads = [json.loads(e) for e in events[:-1]]
    else:
        payloads = [r.json()] if r.content else []
    for p in payloads:
        for item in p if isinstance(p, list) else [p]:
            check_payload(item, what)


def check_payload(p: dict, what: object) -> None:
    if "error" in p:  # a stream's in-band error: the client's fault, never the server's
        assert_error_shape(p, what)
        assert p["error"]["code"] != "internal_error", (p, what)
        return
    for choice in p.get("choices") or []:
        assert choice.get("finish_reason") != "abort", (p, what)
    reason = (p.get("meta_info") or {}).get("finish_reason")
    assert not (isinstance(reason, dict) and reason.get("type") == "abort"), (p, what)


def fuzz_route(path: str, body: st.SearchStrategy, examples: int):
    @settings(FUZZ, max_examples=examples)
    @given(body=body)
    def run(http, body):
        check(send(http, "POST", path, encode(body)), body)

    return run


def test_chat_completions_fuzz(http, reference):
    fuzz_route("/v1/chat/completions", st.one_of(chat_body, plausible_chat), EXAMPLES["chat"])(http)
    wait_idle(http, KV_TOTAL)


def test_completions_fuzz(http, reference):
    fuzz_route("/v1/completions", st.one_of(completion_body, plausible_completion), EXAMPLES["completions"])(
        http
    )
    wait_idle(http, KV_TOTAL)


def test_generate_fuzz(http, reference):
    fuzz_route("/generate", st.one_of(generate_body, plausible_generate), EXAMPLES["generate"])(http)
    wait_idle(http, KV_TOTAL)


def test_tokenize_detokenize_and_abort_fuzz(http, reference):
    fuzz_route("/v1/tokenize", st.one_of(tokenize_body, plausible_tokenize), EXAMPLES["tokenize"])(http)
    fuzz_route("/v1/detokenize", detokenize_body, EXAMPLES["detokenize"])(http)
    fuzz_route("/abort_request", st.fixed_dictionaries({"rid": sometimes_junk(text)}), 10)(http)
    wait_idle(http, KV_TOTAL)


def test_raw_bodies_methods_and_paths_fuzz(http, reference):
    @settings(FUZZ, max_examples=EXAMPLES["raw"])
    @given(req=raw_request)
    def run(req):
        method, path, content, content_type = req
        check(send(http, method, path, content, content_type), req[:2] + (content[:80], content_type))

    run()
    wait_idle(http, KV_TOTAL)


def test_every_raw_edge_body_on_every_route(http, reference):
    """Each hand-picked hostile body on each POST route: the cases a random draw may miss."""
    for path in ROUTES:
        for content in RAW:
            check(send(http, "POST", path, content), (path, content[:80]))
    wait_idle(http, KV_TOTAL)


def test_the_thinking_comes_apart_from_the_answer(http):
    """deepseek-r1: the output begins inside the thinking, so what SmolLM2 writes before any
    </think> is reasoning; the body and the stream split it alike, and usage counts it."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message, usage = r.json()["choices"][0]["message"], r.json()["usage"]
    assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] <= usage["completion_tokens"]
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    deltas = [
        json.loads(e)["choices"][0]["delta"]
        for e in sse_events(r.text)
        if e != "[DONE]" and json.loads(e)["choices"]
    ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    wait_idle(http, KV_TOTAL)


def test_engine_unharmed_after_fuzzing(http, reference):
    """Runs last: the pool is idle, readiness holds and greedy output is what it was."""
    wait_idle(http, KV_TOTAL)
    assert http.get("/health_generate").status_code == 200
    body, text = reference
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    wait_idle(http, KV_TOTAL)
