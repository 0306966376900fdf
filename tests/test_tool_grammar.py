"""Tool calls generated under their grammar (router/frontend/tool_requests.py builds it, the
workers compile it), on the real SmolLM2 tokenizer: random walks through the structural tag of
each family and tool_choice always give calls that the family's parser reads and whose
arguments validate against the function's schema; `auto` leaves text free until a call opens."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from radixserve.router.frontend.schemas import ChatCompletionRequest
from radixserve.router.frontend.tool_parsers import parse_all
from radixserve.router.frontend.tool_requests import plan_tools
from radixserve.workers.constrained.grammar_backend import GrammarBackend
from radixserve.workers.protocol import InvalidRequest
from tests.test_grammar import IM_END, PAD, _load_tokenizer, allowed

torch.set_num_threads(2)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def tok():
    return _load_tokenizer()


@pytest.fixture(scope="module")
def texts(tok):
    return tok.batch_decode([[i] for i in range(len(tok))])


@pytest.fixture(scope="module")
def backend(tok):
    with GrammarBackend(tok, len(tok) + PAD, stop_token_ids=[IM_END], max_workers=1) as backend:
        yield backend


def plan(family: str, **fields):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    )
    return plan_tools(req, family, template_knows_tools=True)[0]


def walk(backend, tok, texts, grammar_text: str, seed: int, prefix: str = "", max_steps: int = 400) -> str:
    """Uniform among allowed tokens (stop tokens once allowed, after a while), until the end."""
    grammar = backend.new_matcher(backend.submit("structural_tag", grammar_text).result(timeout=60))
    closer = np.array([any(c in t for c in '"}]>') for t in texts] + [False] * PAD)
    rng = random.Random(seed)
    for t in tok.encode(prefix, add_special_tokens=False):
        assert grammar.accept_token(t)
    out: list[int] = []
    for step in range(max_steps):
        ids = allowed(backend, grammar)
        assert ids.size > 0, f"no token allowed after {tok.decode(out)!r}"
        others = [t for t in ids if t != IM_END]
        if IM_END in ids and (not others or step > 60):
            token = IM_END
        elif step > 60 and closer[others].any():
            token = rng.choice([t for t in others if closer[t]])
        else:
            token = rng.choice(others)
        assert grammar.accept_token(int(token))
        if grammar.is_terminated():
            return tok.decode(out)
        out.append(int(token))
    raise AssertionError(f"did not end: {tok.decode(out)!r}")


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize(
    "choice,parallel,names",
    [
        ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}),
        ("required", False, {"get_weather", "get_time"}),
        ("required", True, {"get_weather", "get_time"}),
    ],
)
def test_constrained_calls_always_parse_and_validate(backend, tok, texts, family, choice, parallel, names):
    p = plan(family, tool_choice=choice, parallel_tool_calls=parallel)
    assert p.grammar is not None
    counts = set()
    for seed in range(6):
        text = walk(backend, tok, texts, p.grammar, seed)
        parser = parse_all(p.parser(), text)
        assert parser.content == "", text
        assert parser.calls, text
        counts.add(len(parser.calls))
        for call in parser.calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if not parallel:
        assert counts == {1}


def test_auto_is_free_until_a_call_opens_then_strict_arguments_validate(backend, tok, texts):
    p = plan("hermes", tool_choice="auto")
    assert p.grammar is not None
    for seed in range(4):
        text = walk(
            backend,
            tok,
            texts,
            p.grammar,
            seed,
            prefix='Sure. <tool_call>\n{"name": "get_weather", "arguments": ',
        )
        parser = parse_all(p.parser(), 'Sure. <tool_call>\n{"name": "get_weather", "arguments": ' + text)
        assert parser.content.startswith("Sure.")  # and whatever free text follows the call
        assert parser.calls[0].name == "get_weather"
        jsonschema.validate(json.loads(parser.calls[0].arguments), WEATHER)
    grammar = backend.new_matcher(backend.submit("structural_tag", p.grammar).result(timeout=60))
    for t in tok.encode("Any text at all, {json} too.", add_special_tokens=False):
        assert grammar.accept_token(t)
    assert grammar.accept_token(IM_END)


def accepts(backend, grammar_text: str, ids: list[int]) -> bool:
    grammar = backend.new_matcher(backend.submit("structural_tag", grammar_text).result(timeout=60))
    return all(grammar.accept_token(t) for t in ids)


def test_llama3_auto_is_text_or_calls_from_the_first_character(backend, tok, texts):
    p = plan("llama3", tool_choice="auto")
    opened = '{"name": "get_weather", "parameters": '
    for seed in range(3):
        text = opened + walk(backend, tok, texts, p.grammar, seed, prefix=opened)
        parser = parse_all(p.parser(), text)
        assert parser.content == "" and parser.calls[0].name == "get_weather", text
        jsonschema.validate(json.loads(parser.calls[0].arguments), WEATHER)  # strict: its schema
    text = tok.encode("Paris is sunny, {mostly}.", add_special_tokens=False)
    assert accepts(backend, p.grammar, [*text, IM_END])  # a message that starts as text stays free
    assert accepts(backend, p.grammar, [IM_END])
    # A `{` first is a call (the parser reads it as one), so it must be one of the tools'.
    assert not accepts(backend, p.grammar, tok.encode('{"city": "Paris"}', add_special_tokens=False))
    assert not accepts(backend, p.grammar, tok.encode(' {"name": "x"', add_special_tokens=False))


def test_mistral_auto_opens_at_its_marker_as_text_or_as_its_special_token(backend, tok, texts):
    opened = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": '
    p = plan("mistral", tool_choice="auto")  # SmolLM2's tokenizer spells the marker as text
    for seed in range(3):
        text = opened + walk(backend, tok, texts, p.grammar, seed, prefix=opened)
        parser = parse_all(p.parser(), text)
        assert parser.content.startswith("Sure.") and parser.calls[0].name == "get_weather", text
        jsonschema.validate(json.loads(parser.calls[0].arguments), WEATHER)
    free = tok.encode("No call [TOOL] here {x}.", add_special_tokens=False)
    assert accepts(backend, p.grammar, [*free, IM_END])
    # Where the tokenizer has the marker as a special token, the output is parsed only: the
    # grammar vocabulary keeps special tokens out of all text, so none could open a tag.
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "auto"}
    )
    special, _ = plan_tools(req, "mistral", True, {"[TOOL_CALLS]": 5})
    assert special is not None and special.grammar is None and special.family == "mistral"
    assert plan_tools(
        req.model_copy(update={"tool_choice": "required"}), "mistral", True, {"[TOOL_CALLS]": 5}
    )[0].grammar


def test_none_parses_nothing():
    assert plan("hermes", tool_choice="none").family is None
    assert plan("llama3", tool_choice="none").grammar is None


def test_a_schema_the_grammar_cannot_enforce_is_refused(backend):
    bad = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
            "tool_choice": "required",
        }
    )
    p = plan_tools(req, "hermes", template_knows_tools=True)[0]
    with pytest.raises(InvalidRequest) as e:
        backend.submit("structural_tag", p.grammar).result(timeout=60)
    assert e.value.param == "structural_tag" and e.value.code == "unsupported_schema_feature"


def test_a_tiny_qwen3_engine_calls_under_the_grammar_and_the_call_parses(tmp_path):
    """The whole path on a tiny random Qwen3 checkpoint with Qwen3's own template: the prompt the
    template writes, the engine's grammar, and the parser reading what it generated."""
    from transformers import AutoTokenizer

    from radixserve.router.frontend.chat_template import ChatTemplate
    from radixserve.router.frontend.tool_requests import template_knows_tools
    from radixserve.workers import Engine
    from tests.chat_templates import QWEN3
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, arch="qwen3", chat_template=QWEN3)
    template = ChatTemplate(AutoTokenizer.from_pretrained(path))
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": "required"}
    )
    p, messages = plan_tools(req, "qwen", template_knows_tools(QWEN3))
    ids = template.encode(messages, tools=p.tools)
    engine = Engine(path, dtype="float32", num_threads=1, max_total_tokens=2048)
    try:
        outs = engine.generate(
            input_ids=[ids] * 3,
            sampling_params={
                "max_new_tokens": 200,
                "temperature": 1.0,
                "seed": 5,
                "structural_tag": p.grammar,
            },
        )
    finally:
        engine.shutdown()
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        parser = parse_all(p.parser(), out["text"])
        assert parser.content == "" and parser.calls, out["text"]
        for call in parser.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
