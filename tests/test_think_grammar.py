"""Constrained decoding after thinking (workers/constrained/think_grammar.py), on the real SmolLM2
tokenizer: the thinking takes any text token by token, the answer's constraint starts right
after the end tag (the same exact bitmask as the answer's grammar alone), jump-forward forces
nothing while thinking, and random walks through thinking then answer validate."""

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from radixserve.workers.constrained.grammar import jump_forward_tokens
from radixserve.workers.constrained.grammar_backend import GrammarBackend
from radixserve.workers.protocol import InvalidRequest, SamplingParams
from tests.test_grammar import IM_END, PAD, _load_tokenizer, allowed

torch.set_num_threads(2)

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "why": {"type": "string", "maxLength": 20}},
    "required": ["answer", "why"],
}


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


def matcher(backend, kind, text, reasoning=None):
    return backend.new_matcher(backend.submit(kind, text, reasoning).result(timeout=60))


def feed(tok, grammar, text):
    for token in tok.encode(text, add_special_tokens=False):
        assert grammar.accept_token(token), f"{tok.decode([token])!r} refused in {text!r}"


def text_tokens(tok, texts):
    """Tokens with text of their own (never special ones: those are no grammar's text)."""
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return np.array([i for i, t in enumerate(texts) if t and i not in special])


def test_thinking_allows_every_text_token_but_not_the_end_of_output(backend, tok, texts):
    grammar = matcher(backend, "json_schema", json.dumps(SCHEMA), "deepseek-r1")
    free = text_tokens(tok, texts)
    for piece in ["", "Let me think.\n\n", "{not json} ", "</thi", "nk maybe ", "\t<think>"]:
        feed(tok, grammar, piece)
        ids = set(allowed(backend, grammar).tolist())
        missing = [int(t) for t in free if int(t) not in ids and "</think>" not in texts[t]]
        assert missing == [], f"after {piece!r}: {[texts[t] for t in missing[:5]]}"
        assert IM_END not in ids  # the answer is still owed
        assert grammar.jump_forward() == ""  # nothing is forced while thinking


@pytest.mark.parametrize("kind, text", [("json_schema", json.dumps(SCHEMA)), ("regex", "(yes|no)")])
def test_after_the_end_tag_the_mask_is_the_answers(backend, tok, kind, text):
    plain = matcher(backend, kind, text)
    for reasoning, thinking in [("deepseek-r1", "hmm, {\n</th</think>"), ("qwen3", "<think>a\nb</think>")]:
        grammar = matcher(backend, kind, text, reasoning)
        feed(tok, grammar, thinking)
        assert np.array_equal(allowed(backend, grammar), allowed(backend, plain)), reasoning


def test_a_length_limited_string_after_thinking_admits_no_control_character(backend, tok, texts):
    # The composed grammar is compiled against the free-text vocabulary (the thinking may hold
    # newlines), so the string rule itself must keep raw control characters out.
    grammar = matcher(backend, "json_schema", json.dumps(SCHEMA), "deepseek-r1")
    feed(tok, grammar, 'a\nb</think>{"answer": 1, "why": "x')
    ids = allowed(backend, grammar).tolist()
    assert len(ids) > 10000
    assert not [i for i in ids if any(ord(c) < 32 for c in texts[i])]
    thinking = matcher(backend, "json_schema", json.dumps(SCHEMA), "deepseek-r1")
    assert any(any(ord(c) < 32 for c in texts[i]) for i in allowed(backend, thinking))  # \n, thinking


def test_qwen3_thinking_is_optional_and_opens_the_output(backend, tok):
    schema = json.dumps(SCHEMA)
    direct = matcher(backend, "json_schema", schema, "qwen3")
    feed(tok, direct, '{"answer": 4, "why": "x"}')
    assert direct.accept_token(IM_END) and direct.is_terminated()
    grammar = matcher(backend, "json_schema", schema, "qwen3")
    assert not any(grammar.accept_token(t) for t in tok.encode("hmm</think>", add_special_tokens=False)[:1])
    deepseek = matcher(backend, "json_schema", schema, "deepseek-r1")
    feed(tok, deepseek, '{"answer": 4, "why": "x"}')  # thinking text: the answer is still owed
    assert not deepseek.accept_token(IM_END)


def test_the_first_end_tag_ends_the_thinking(backend, tok):
    grammar = matcher(backend, "regex", "(yes|no)", "deepseek-r1")
    feed(tok, grammar, "think</think>")
    assert not grammar.accept_token(tok.encode("more", add_special_tokens=False)[0])
    feed(tok, grammar, "yes")
    assert grammar.accept_token(IM_END) and grammar.is_terminated()


def test_jump_forward_after_thinking(backend, tok):
    schema = {"type": "object", "properties": {"customer_full_name": {"type": "string"}}}
    schema["required"] = ["customer_full_name"]
    grammar = matcher(backend, "json_schema", json.dumps(schema), "deepseek-r1")
    feed(tok, grammar, "ok</think>")
    assert grammar.jump_forward() == '{"customer_full_name": "'
    tokens = jump_forward_tokens(tok, grammar, max_tokens=2)
    assert len(tokens) <= 2 and tokens == tok.encode('{"customer_full_name": "')[:2]


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_think_then_validate(backend, tok, texts, seed):
    """Random thinking tokens (their text may be anything), the end tag, then a random walk of
    the answer that prefers closing tokens after a while: the answer validates."""
    rng = random.Random(seed)
    grammar = matcher(backend, "json_schema", json.dumps(SCHEMA), "deepseek-r1")
    free = [int(t) for t in text_tokens(tok, texts) if "<" not in texts[t]]
    thinking = [rng.choice(free) for _ in range(40)]
    for token in thinking:
        assert grammar.accept_token(token)
    feed(tok, grammar, "</think>")
    closer = np.array([any(c in t for c in '"}') for t in texts] + [False] * PAD)
    out: list[int] = []
    for step in range(400):
        ids = allowed(backend, grammar)
        if IM_END in ids:
            assert grammar.accept_token(IM_END) and grammar.is_terminated()
            break
        pool = [int(t) for t in ids if closer[t]] if step > 20 else []
        token = rng.choice(pool or [int(t) for t in ids])
        assert grammar.accept_token(token)
        out.append(token)
    else:
        raise AssertionError(f"walk did not end: {tok.decode(out)!r}")
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


def test_reasoning_is_part_of_the_compile_key(backend):
    plain = backend.submit("regex", "(yes|no)").result(timeout=60)
    composed = backend.submit("regex", "(yes|no)", "qwen3").result(timeout=60)
    assert plain is not composed
    assert backend.submit("regex", "(yes|no)", "qwen3").result(timeout=60) is composed


def test_unknown_reasoning_format():
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({"regex": "a", "reasoning": "nope"})
    assert e.value.param == "reasoning"
    with pytest.raises(InvalidRequest):
        SamplingParams.from_dict({"reasoning": ["qwen3"]})
    assert SamplingParams.from_dict({"regex": "a", "reasoning": "qwen3"}).grammar == ("regex", "a", "qwen3")
    assert SamplingParams.from_dict({"reasoning": "qwen3"}).grammar is None
