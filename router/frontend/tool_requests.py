"""A chat request's tools: checked, written into the prompt, and turned into a grammar.

`plan_tools` refuses bad definitions with a 400 naming the field (before anything is tokenized,
so nothing reaches an engine) and returns a `ToolPlan`: the family the output is parsed in, the
grammar (an xgrammar structural tag) its calls are generated under, and the messages and tool
list as the chat template takes them.

When the calls are constrained: with `tool_choice` "required" or a named function, the whole
output is calls in the family's syntax, their arguments generated under each function's schema
(a named function: one call to it; "required": calls to any of the tools, one, or one or more
with `parallel_tool_calls`). With "auto", hermes-family output is free text until the model opens a
call, which is then generated under the schema of the function it names when that function is
`strict`, else as any JSON object. What opens a call is the family's: hermes' `<tool_call>` text
anywhere; mistral's `[TOOL_CALLS]` anywhere where the tokenizer spells it as text; llama3's `{`
as the message's first character (its parser reads a message that starts otherwise as content,
so that is the only place a call can be, and a message that starts with text stays free). Where
mistral's marker is a special token, "auto" output is parsed, not constrained: the grammar
vocabulary keeps special tokens out of all text (workers/constrained/vocab.py), and xgrammar then
cannot let one open a tag either. "none" writes the tools into the prompt (so
the prefix is the same as with calls) and parses nothing.

Chat templates that know no tools get the Hermes convention: the definitions in the system
message, calls as `<tool_call>` blocks in the assistant's text, results as `<tool_response>`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.router.frontend.schemas import ChatCompletionRequest, ChatMessage
from radixserve.router.frontend.tool_parsers import MistralParser, ToolCallParser, parser_class
from radixserve.workers.protocol import MAX_GRAMMAR_CHARS, MAX_JSON_DEPTH, InvalidRequest

# OpenAI's rule for function names; it also keeps names literal inside a grammar's strings.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
# Whitespace the grammar allows between JSON tokens of the arguments: room for a model's own
# spacing, never a run of it that eats the token budget.
MAX_ARGUMENT_WHITESPACE = 4
# What each family writes around one call, when the call is generated under a grammar.
_CALL_FRAMES = {
    "hermes": ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"),
    "llama3": ('{{"name": "{name}", "parameters": ', "}", "; "),
    "mistral": ('{{"name": "{name}", "arguments": ', "}", ", "),
}
_FAMILY = {"qwen": "hermes"}
# A llama3 message that is not calls: empty, or text whose first non-space is anything but `{`.
_NOT_A_CALL = r"(\s*[^{\s][\s\S]*)?"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolPlan:
    family: str | None  # parse the output in this family's syntax (None: do not parse)
    grammar: str | None  # the structural tag the output is generated under
    prefix: str  # text the grammar's output is parsed after (a marker it cannot write)
    tools: list[dict[str, Any]] | None  # the template's `tools`

    def parser(self) -> ToolCallParser | None:
        if self.family is None:
            return None
        p = parser_class(self.family)()
        if self.prefix:
            p.feed(self.prefix)
        return p


def plan_tools(
    req: ChatCompletionRequest,
    family: str | None,
    template_knows_tools: bool,
    special_ids: Mapping[str, int] | None = None,
) -> tuple[ToolPlan | None, list[dict[str, Any]]]:
    """(the plan, or None without tools; the messages as the chat template takes them).
    `special_ids`: the tokenizer's special tokens by text (a call marker that is one of them is
    matched as that token)."""
    tools = [t.function for t in req.tools] if req.tools is not None else None
    choice = req.tool_choice
    if tools is None:
        if choice is not None and choice != "none":
            raise InvalidRequest("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None, template_messages(req.messages, hermes=False)
    _check_definitions(req)
    defs = [_definition(f) for f in tools]
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    if named is not None and named not in {f.name for f in tools}:
        raise InvalidRequest(f"tool_choice names function {named!r}, which is not in 'tools'", "tool_choice")
    # "none", "auto", "required", or "named" (never the name itself: a function may be called "auto")
    mode = "named" if named is not None else choice if isinstance(choice, str) else "auto"
    if mode == "none":
        fam = None
    elif family is None:
        raise InvalidRequest(
            "this model's chat template does not say how it writes tool calls; start the server "
            "with --tool-call-parser",
            "tools",
        )
    else:
        fam = _FAMILY.get(family, family)
    other = [k for k in ("regex", "ebnf", "json_schema") if getattr(req, k) is not None]
    if req.response_format is not None and req.response_format.type != "text":
        other.append("response_format")
    grammar, prefix = None, ""
    if fam is not None and mode != "auto" and other:
        what = "a named tool_choice" if named is not None else f"tool_choice {mode!r}"
        raise InvalidRequest(f"'{other[0]}' cannot be combined with {what}", other[0])
    if fam is not None and not other:
        # A named function is called once; otherwise parallel_tool_calls (default true) allows more.
        parallel = req.parallel_tool_calls is not False and named is None
        grammar = _grammar(fam, tools, mode, named, parallel, special_ids or {})
        prefix = "[TOOL_CALLS]" if fam == "mistral" and mode != "auto" else ""
    messages = template_messages(req.messages, hermes=not template_knows_tools)
    if not template_knows_tools:
        messages = _with_hermes_system(messages, defs)
    return ToolPlan(fam, grammar, prefix, defs if template_knows_tools else None), messages


def _definition(f: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        fn["description"] = f.description
    fn["parameters"] = f.parameters if f.parameters is not None else _EMPTY_PARAMETERS
    return {"type": "function", "function": fn}


def _check_definitions(req: ChatCompletionRequest) -> None:
    assert req.tools is not None
    if not req.tools:
        raise InvalidRequest("'tools' must not be empty; leave it out to call no tools", "tools")
    if len(req.tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools are allowed", "tools")
    seen: set[str] = set()
    size = 0
    for k, tool in enumerate(req.tools):
        f = tool.function
        where = f"tools.{k}.function"
        if not _NAME.match(f.name):
            raise InvalidRequest(
                f"function name {f.name!r} must be 1 to 64 letters, digits, '_' or '-'", f"{where}.name"
            )
        if f.name in seen:
            raise InvalidRequest(f"function name {f.name!r} is defined twice", f"{where}.name")
        seen.add(f.name)
        schema = f.parameters
        if schema is None:
            continue
        if schema.get("type") != "object":
            raise InvalidRequest(
                'a function\'s parameters must be a JSON schema of an object ({"type": "object", ...})',
                f"{where}.parameters",
            )
        if _depth(schema) > MAX_JSON_DEPTH:
            raise InvalidRequest(
                f"the parameters schema nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
                f"{where}.parameters",
            )
        size += len(json.dumps(schema))
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(
            f"the tools' parameter schemas are {size} characters long together; at most "
            f"{MAX_GRAMMAR_CHARS} are allowed",
            "tools",
        )


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _grammar(
    family: str,
    tools: list[Any],
    mode: str,
    named: str | None,
    parallel: bool,
    special_ids: Mapping[str, int],
) -> str | None:
    """The structural tag the output is generated under (None: unconstrained)."""
    begin, end, separator = _CALL_FRAMES[family]
    constrained = mode != "auto"
    chosen = [f for f in tools if named is None or f.name == named]

    def tag(f: Any) -> dict[str, Any]:
        schema = f.parameters if f.parameters is not None else _EMPTY_PARAMETERS
        if not constrained and not f.strict:
            schema = {"type": "object"}
        content = {
            "type": "json_schema",
            "json_schema": schema,
            "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE,
        }
        return {"type": "tag", "begin": begin.format(name=f.name), "content": content, "end": end}

    tags = [tag(f) for f in chosen]
    if not constrained and family == "hermes":
        fmt: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": tags,
            "stop_after_first": not parallel,
        }
        return json.dumps({"type": "structural_tag", "format": fmt})
    fmt = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if family == "mistral":
        fmt = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "["},
                fmt,
                {"type": "const_string", "value": "]"},
            ],
        }
    if not constrained:
        opened = _opened_by(family, fmt, special_ids)
        if opened is None:
            return None
        fmt = opened
    return json.dumps({"type": "structural_tag", "format": fmt})


def _opened_by(family: str, calls: dict[str, Any], special_ids: Mapping[str, int]) -> dict[str, Any] | None:
    """Free text in which `calls` begin where the family's parser reads a call (under "auto");
    None where no grammar can say so."""
    if family == "llama3":
        # Either calls from the first character, or text whose first non-space is not a `{`.
        return {"type": "or", "elements": [calls, {"type": "regex", "pattern": _NOT_A_CALL}]}
    marker = MistralParser.opener
    if marker in special_ids:
        return None
    return {"type": "dispatch", "rules": [[marker, calls]], "loop": False}


def template_messages(messages: list[ChatMessage], hermes: bool) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: roles it knows, text contents, calls with
    their arguments as objects (what templates that write them with `tojson` expect). With
    `hermes`, calls and results are written into the contents instead (the Hermes convention)."""
    out = []
    for k, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise InvalidRequest("only assistant messages carry 'tool_calls'", f"messages.{k}.tool_calls")
            calls = [_call(k, j, c) for j, c in enumerate(m.tool_calls)]
            if hermes:
                blocks = [
                    "<tool_call>\n"
                    + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    + "\n</tool_call>"
                    for c in calls
                ]
                d["content"] = "\n".join(([d["content"]] if d["content"] else []) + blocks)
            else:
                d["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequest(
                    "a tool message needs the 'tool_call_id' it answers", f"messages.{k}.tool_call_id"
                )
            d["tool_call_id"] = m.tool_call_id
            if hermes:
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        elif m.tool_call_id is not None:
            raise InvalidRequest("only tool messages carry 'tool_call_id'", f"messages.{k}.tool_call_id")
        out.append(d)
    return out


def _call(k: int, j: int, call: Any) -> dict[str, Any]:
    param = f"messages.{k}.tool_calls.{j}.function.arguments"
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        raise InvalidRequest("a tool call's arguments must be JSON text of an object", param) from None
    if not isinstance(arguments, dict):
        raise InvalidRequest("a tool call's arguments must be JSON text of an object", param)
    if _depth(arguments) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"a tool call's arguments nest more than {MAX_JSON_DEPTH} levels deep", param)
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def _with_hermes_system(messages: list[dict[str, Any]], defs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(d, ensure_ascii=False) for d in defs))
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


@functools.lru_cache(maxsize=16)  # per template text (a str caches its hash)
def template_knows_tools(chat_template: str | None) -> bool:
    """Whether the template writes the `tools` it is given (else the Hermes convention is used)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None
