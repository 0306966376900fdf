"""Constrained decoding through the engine with the real default model."""

import asyncio
import json
import re

import jsonschema
import pytest

from radixserve.workers import Engine
from radixserve.workers.protocol import InvalidRequest
from tests.engine_utils import assert_kv_invariant

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "items": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 3,
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                            },
                            "required": ["sku", "qty"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["id", "items"],
                "additionalProperties": False,
            }
        },
        "required": ["order"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["score", "tags", "ok"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine():
    e = Engine(max_total_tokens=8192)
    yield e
    e.shutdown()


@pytest.fixture(autouse=True)
def invariant(engine):
    yield
    assert_kv_invariant(engine)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, name, temperature):
    schema = SCHEMAS[name]
    outs = engine.generate(
        ["Describe it as JSON:", "Here is the data:"],
        {"max_new_tokens": 160, "temperature": temperature, "seed": 7, "json_schema": json.dumps(schema)},
    )
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_and_choices_fullmatch(engine):
    cases = [
        r"(yes|no)",
        r"[0-9]{3}-[0-9]{4}",
        r"(red|green|blue) (car|bike)",
        r"[A-Z][a-z]{2,8}@example\.com",
    ]
    outs = engine.generate(
        ["Answer:"] * len(cases),
        [{"max_new_tokens": 40, "temperature": 0.7, "seed": 3, "regex": rx} for rx in cases],
    )
    for rx, out in zip(cases, outs):
        assert re.fullmatch(rx, out["text"]), (rx, out["text"])


def test_ebnf_output_parses(engine):
    grammar = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [1-9] [0-9]?'
    out = engine.generate("A sum:", {"max_new_tokens": 30, "temperature": 0.8, "seed": 1, "ebnf": grammar})
    if out["meta_info"]["finish_reason"]["type"] == "length":  # sampled: may be cut after a "+"
        assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*\+?", out["text"]), out["text"]
        assert out["meta_info"]["completion_tokens"] == 30
    else:
        assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", out["text"]), out["text"]


def test_constrained_and_free_requests_batched_together(engine):
    free = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = engine.generate("The capital of France is", free)
    outs = engine.generate(
        ["Person:", "The capital of France is", "Pick:"],
        [
            {"max_new_tokens": 120, "temperature": 0, "json_schema": json.dumps(SCHEMAS["person"])},
            free,
            {"max_new_tokens": 10, "regex": "(alpha|beta|gamma)"},
        ],
    )
    jsonschema.validate(json.loads(outs[0]["text"]), SCHEMAS["person"])
    assert outs[1]["output_ids"] == alone["output_ids"]
    assert outs[2]["text"] in ("alpha", "beta", "gamma")


def test_n_greater_than_one_and_stop_strings(engine):
    outs = engine.generate(
        "List:",
        {
            "max_new_tokens": 30,
            "temperature": 1.0,
            "seed": 11,
            "n": 3,
            "regex": r"[a-z]{1,6}(, [a-z]{1,6}){2}",
        },
    )
    assert len(outs) == 3
    for o in outs:
        assert re.fullmatch(r"[a-z]{1,6}(, [a-z]{1,6}){2}", o["text"])
    out = engine.generate(
        "List:",
        {"max_new_tokens": 30, "temperature": 0, "regex": r"[a-z]{1,6}(, [a-z]{1,6}){2}", "stop": [","]},
    )
    assert "," not in out["text"] and out["meta_info"]["finish_reason"]["matched"] == ","


def test_jump_forward_saves_steps(engine):
    schema = {
        "type": "object",
        "properties": {
            "customer_full_name": {"type": "string", "maxLength": 12},
            "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
        },
        "required": ["customer_full_name", "customer_account_identifier"],
        "additionalProperties": False,
    }
    before = engine.stats()["jump_forward_tokens_total"]
    out = engine.generate(
        "Customer record:", {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(schema)}
    )
    jsonschema.validate(json.loads(out["text"]), schema)
    assert engine.stats()["jump_forward_tokens_total"] - before >= 8


SELF_REQUIRED = {"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "constraint",
    [{"ebnf": 'root ::= "a" root'}, {"json_schema": json.dumps(SELF_REQUIRED)}],
    ids=["a-root", "self-required"],
)
def test_a_grammar_forced_forever_is_served_to_its_length_limit(engine, constraint):
    """Jump-forward over a continuation the grammar forces forever takes a bounded jump per step,
    and the request ends at max_new_tokens beside a request batched with it."""
    import asyncio
    import time

    params = dict(constraint, max_new_tokens=30, temperature=0)
    mate = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def both():
        return await asyncio.gather(engine.async_generate("x", params), engine.async_generate("Hello", mate))

    started = time.monotonic()
    forced, other = asyncio.run(both())
    assert time.monotonic() - started < 30
    assert forced["meta_info"]["finish_reason"]["type"] == "length"
    assert forced["meta_info"]["completion_tokens"] == 30
    expected = "a" * len(forced["text"]) if "ebnf" in constraint else '{"next": ' * 3
    assert forced["text"].startswith(expected[:27]) and forced["text"]
    assert other["meta_info"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "params,param_name",
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": '{"items": ' * 5000 + "{}" + "}" * 5000}, "json_schema"),  # past recursion
        ({"regex": "a" * 300_000}, "regex"),
        ({"json_schema": json.dumps({"type": "object", "uniqueItems": True, "not": {}})}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= "}, "ebnf"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ],
)
def test_bad_grammars_refused_and_engine_keeps_serving(engine, params, param_name):
    with pytest.raises(InvalidRequest) as e:
        engine.generate("x", dict(params, max_new_tokens=5))
    assert e.value.param == param_name and e.value.message
    ok = engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0})
    assert ok["meta_info"]["completion_tokens"] == 3 or ok["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    "grammar,generated",
    [
        ('root ::= root "a"', 0),  # no string at all: a dead end before the first token
        ('root ::= "b" x\nx ::= x "c"', 1),  # "b", then a rule that never ends
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_grammar_dead_end_is_the_requests_error_not_the_engines(engine, grammar, generated, stream):
    """A grammar that compiles but leaves no token to sample is an InvalidRequest (a 400) for
    that request only: never an EngineError (a 500), and a request batched with it finishes."""
    import asyncio

    failed_before = engine.stats()["num_failed_total"]
    params = {"max_new_tokens": 6, "temperature": 0, "ebnf": grammar}
    mate = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def dead_end():
        if not stream:
            return await engine.async_generate("x", params)
        async for _ in await engine.async_generate("x", params, stream=True):
            pass

    async def both():
        return await asyncio.gather(dead_end(), engine.async_generate("Hello", mate), return_exceptions=True)

    err, ok = asyncio.run(both())
    assert isinstance(err, InvalidRequest), err
    assert (err.param, err.code) == ("ebnf", "grammar_dead_end")
    assert f"after {generated} generated token(s)" in err.message
    assert ok["meta_info"]["completion_tokens"] == 6
    assert engine.stats()["num_failed_total"] == failed_before


def test_engine_shutdown_stops_the_grammar_compile_workers():
    import psutil

    engine = Engine(max_total_tokens=2048, num_threads=1)
    try:
        out = engine.generate("Say yes:", {"max_new_tokens": 4, "temperature": 0, "regex": "(yes|no)"})
        assert out["text"] in ("yes", "no")
        pids = engine.core.grammars.backend.worker_pids()
        assert pids and all(psutil.pid_exists(p) for p in pids)
    finally:
        engine.shutdown()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)
    assert not alive


def test_a_resumed_request_replays_its_prefix_through_the_grammar(engine):
    """PD recompute of a constrained request: the grammar is advanced by the tokens the client
    has, so what follows still completes the pattern (and equals the uninterrupted greedy run)."""
    from radixserve.workers.protocol import GenerateRequest, SamplingParams

    params = {"max_new_tokens": 30, "temperature": 0, "regex": r"[a-z]{1,6}(, [a-z]{1,6}){2}"}
    ids = engine.tokenizer.encode("List three fruits:")
    whole = engine.generate(input_ids=ids, sampling_params=params)
    assert re.fullmatch(params["regex"], whole["text"])
    full = whole["output_ids"]
    k = len(full) // 2
    req = GenerateRequest(list(ids), SamplingParams.from_dict(params), output_prefix=[full[:k]])
    (out,) = asyncio.run(engine._collect(req))
    assert out["output_ids"] == full[k:] and re.fullmatch(params["regex"], whole["text"])
    # A prefix the grammar refuses fails the request with a clear error.
    bad = engine.tokenizer.encode("123")
    req = GenerateRequest(list(ids), SamplingParams.from_dict(params), output_prefix=[bad])
    with pytest.raises(Exception, match="resuming from the tokens sent failed"):
        asyncio.run(engine._collect(req))


def test_a_padded_lm_head_never_yields_a_token_past_the_vocabulary(tmp_path):
    """A model whose LM head is padded past the tokenizer (as Qwen2's 151,936 columns for 151,665
    tokens): a constrained request never samples a column past the tokenizer's vocabulary."""
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "qwen2", vocab_size=49152 + 128)
    padded = Engine(path, dtype="float32", max_total_tokens=2048)
    try:
        params = {"max_new_tokens": 24, "temperature": 0, "regex": "[a-c]{3,8}"}
        out = padded.generate("Three letters:", params)
        assert re.fullmatch("[a-c]{3,8}", out["text"]), out
        assert max(out["output_ids"]) < 49152
        assert_kv_invariant(padded)
    finally:
        padded.shutdown()
