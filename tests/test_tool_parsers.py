"""The tool-call parsers: every family's output fed whole, cut at every boundary into two and
three pieces, and one character at a time, gives the same content and calls; the deltas have
OpenAI's shape (a call's first delta: index, id, type, name; then its arguments)."""

from __future__ import annotations

import json

import pytest

from radixserve.router.frontend.tool_parsers import Delta, infer_parser, parse_all, parser_class


def fold(deltas: list[Delta]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, as a client rebuilds them from the deltas."""
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for c in d.calls:
            if "id" in c:
                assert c["index"] not in calls
                assert c["type"] == "function" and c["id"].startswith("call_")
                calls[c["index"]] = [c["function"]["name"], c["function"].get("arguments", "")]
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]][1] += c["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[k]) for k in sorted(calls)]


def run(family: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    p = parser_class(family)()
    got = fold([p.feed(x) for x in pieces] + [p.finish()])
    assert got == (p.content, [(c.name, c.arguments) for c in p.calls])
    return got


CASES = [
    pytest.param(
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", '
        '"days": [1, {"a": 2}]}}\n</tool_call>\n<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',
        "Let me check.",
        [("get_weather", '{"city": "Pa\\"ris}", "days": [1, {"a": 2}]}'), ("f", '{"x": 1}')],
        id="hermes-two-calls",
    ),
    pytest.param("hermes", "no calls <tool at all  ", "no calls <tool at all  ", [], id="hermes-no-call"),
    pytest.param(
        "hermes",
        "<tool_call>not json</tool_call> after",
        "<tool_call>not json</tool_call> after",
        [],
        id="hermes-not-a-call",
    ),
    pytest.param(
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"q": "</tool_call>"}}</tool_call>Done.',
        "Done.",
        [("f", '{"q": "</tool_call>"}')],
        id="hermes-closing-tag-inside-a-string",
    ),
    pytest.param(
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1',
        "",
        [("f", '{"a": 1')],
        id="hermes-cut-short",
    ),
    pytest.param(
        "qwen",
        '<tool_call>\n{"name": "f\\u00e9", "id": 3, "arguments": {}}\n</tool_call>',
        "",
        [("f\u00e9", "{}")],
        id="qwen-escaped-name-and-extra-key",
    ),
    pytest.param(
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, \\"}\\"]}"}</tool_call>',
        "",
        [("f", '{"a": [1, "}"]}')],
        id="hermes-arguments-as-a-json-string",
    ),
    pytest.param(
        "llama3",
        '<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; {"name": "g", "parameters": {}}',
        "",
        [("f", '{"a": "b"}'), ("g", "{}")],
        id="llama3-python-tag-two-calls",
    ),
    pytest.param(
        "llama3",
        '\n{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "",
        [("get_weather", '{"city": "Oslo"}')],
        id="llama3-json",
    ),
    pytest.param("llama3", ' Hello {"name"', ' Hello {"name"', [], id="llama3-content"),
    pytest.param("llama3", '{"answer": 42}', '{"answer": 42}', [], id="llama3-json-that-is-no-call"),
    pytest.param(
        "mistral",
        'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abc123456"}, '
        '{"name": "g", "arguments": {}}] done',
        "Suredone",
        [("f", '{"a": 1}'), ("g", "{}")],
        id="mistral-list",
    ),
    pytest.param("mistral", "[TOOL_CALLS] no list", "[TOOL_CALLS] no list", [], id="mistral-no-list"),
]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_every_cut_gives_the_same_result(family, text, content, calls):
    assert run(family, [text]) == (content, calls)
    for i in range(len(text) + 1):
        assert run(family, [text[:i], text[i:]]) == (content, calls), i
    assert run(family, list(text)) == (content, calls)
    step = max(1, len(text) // 25)  # three pieces: every pair of cuts on a grid
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            assert run(family, [text[:i], text[i:j], text[j:]]) == (content, calls), (i, j)


def test_arguments_stream_before_the_call_ends():
    p = parser_class("hermes")()
    first = p.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert first.content == ""
    (call,) = first.calls  # one delta per call and piece: the opening carries what followed it
    assert call == {
        "index": 0,
        "id": p.calls[0].id,
        "type": "function",
        "function": {"name": "f", "arguments": '{"city": "Par'},
    }
    assert p.feed('is"}}').calls == [{"index": 0, "function": {"arguments": 'is"}'}}]
    assert not p.feed("\n</tool_call>")
    assert not p.finish()
    assert json.loads(p.calls[0].arguments) == {"city": "Paris"}


def test_text_that_may_open_a_call_is_held_back():
    p = parser_class("hermes")()
    assert p.feed("Hi <tool").content == "Hi"
    assert p.feed("box").content == " <toolbox"


def test_ids_are_distinct():
    p = parse_all(parser_class("hermes")(), '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 3)
    assert len({c.id for c in p.calls}) == 3


@pytest.mark.parametrize(
    "template,family",
    [
        ("{{ '<tool_call>' }}{% if tools %}{% endif %}", "hermes"),
        ("{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
        ("{{ '<|python_tag|>' }}{{ tools }}", "llama3"),
        ('{{ tools }} "parameters": ', "llama3"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # knows no tools
        ("{% for t in tools %}{{ t }}{% endfor %}", None),  # tools, but no known syntax
        ("{{ '<tool_call>' }}{{ '[TOOL_CALLS]' }}", None),  # two syntaxes
        (None, None),
    ],
)
def test_family_inferred_from_the_template(template, family):
    assert infer_parser(template) == family
