"""Turn a user's grammar text into an xgrammar `Grammar`, or an `InvalidRequest` that says why not.

Everything here runs in the compile worker process (compile_worker.py), never on an event loop or
the engine thread: parsing a large or deeply nested schema takes time, and xgrammar cannot be
interrupted. Only `check_text` (type and length, O(1)) also runs in the caller, so that an
oversized text is refused before it is shipped to the worker.

xgrammar 0.2.9 silently drops some JSON-schema keywords (the output would then not validate
against the schema the user sent), so those are refused here with the path of the offending
keyword instead of being relaxed behind the user's back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import xgrammar as xgr

from radixserve.workers.constrained.think_grammar import after_thinking
from radixserve.workers.protocol import GRAMMAR_KINDS, MAX_GRAMMAR_CHARS, MAX_JSON_DEPTH, InvalidRequest

# The limits (workers/protocol.py) are checked before anything is parsed: an array schema nested
# 128 deep takes 0.25 s to compile, 900 deep 34 s; a compile past the timeout is killed anyway, but
# they refuse the obvious cases at once and with a precise reason. The kinds are also the request
# fields they come from (OpenAI's `param` in the error body).

_TAG_NESTING = 16  # a structural tag's own nesting (tags, sequences) around the schemas it holds

# Keywords xgrammar 0.2.9 accepts but ignores (verified against its converter): honouring the
# request would need them, so a schema using them is refused rather than half-enforced.
_IGNORED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedItems",
)

# Keywords whose value is one subschema, a {name: subschema} map, or a [subschema] list.
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties")
_SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed
# CHECK expression; neither helps a user.
_NOISE = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without the C++ source location, on one line."""
    text = _NOISE.sub("", str(exc).strip())
    text = text.split(" The JSON string is:")[0]  # it echoes the whole (possibly huge) input
    return " ".join(text.split())


def check_text(kind: str, text: Any) -> None:
    """The checks that need no parsing: a known kind (ValueError otherwise: a caller's bug), a
    string, not longer than MAX_GRAMMAR_CHARS (InvalidRequest)."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    if not isinstance(text, str):
        raise InvalidRequest(f"'{kind}' must be a string", kind, "invalid_grammar")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(
            f"the {kind} is {len(text)} characters long; at most {MAX_GRAMMAR_CHARS} are allowed",
            kind,
            "grammar_too_large",
        )


def parse_grammar(
    kind: str, text: str, any_whitespace: bool = False, reasoning: str | None = None
) -> xgr.Grammar:
    """The xgrammar Grammar for (kind, text), after the thinking of the `reasoning` convention
    where one is named (think_grammar.py); raises InvalidRequest (param, code set) if bad."""
    check_text(kind, text)
    if kind == "json_schema":
        check_json_schema(text)
        build = lambda: xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        what, code = "JSON schema", "invalid_schema"
    elif kind == "structural_tag":
        check_structural_tag(text)
        build = lambda: xgr.Grammar.from_structural_tag(text)
        what, code = "structural tag", "invalid_structural_tag"
    elif kind == "regex":
        build = lambda: xgr.Grammar.from_regex(text)
        what, code = "regex", "invalid_regex"
    else:
        build = lambda: xgr.Grammar.from_ebnf(text)
        what, code = "EBNF grammar", "invalid_ebnf"
    try:
        return json_strings_without_controls(after_thinking(build(), reasoning))
    except (RuntimeError, ValueError) as exc:  # a structural tag's pydantic errors are ValueErrors
        raise InvalidRequest(f"invalid {what}: {clean_error(exc)}", kind, code) from None


# xgrammar 0.2.9 writes the characters of a length-limited JSON string (minLength / maxLength) as
# this class, which admits raw control characters; JSON admits none (its other string rules
# exclude \0-\x1f). The JSON vocabulary (vocab.py) drops such tokens, but a grammar compiled
# against the free-text one (after thinking, around tool calls) would let "\x05" into a string.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def json_strings_without_controls(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with each length-limited JSON string's characters as JSON has them (the grammar
    itself where it has none)."""
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def check_json_schema(text: str) -> None:
    """Refuse text that is not JSON, nested deeper than MAX_JSON_DEPTH, not a schema (object or
    bool), or uses unsupported features."""
    try:
        schema = json.loads(text)
    except RecursionError:  # the C parser gives up near sys.getrecursionlimit() levels
        raise _too_deep() from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise InvalidRequest(f"json_schema is not valid JSON: {exc}", "json_schema", "invalid_json") from None
    if _depth(schema) > MAX_JSON_DEPTH:
        raise _too_deep()
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(
            f"a JSON schema must be an object or a boolean, got {type(schema).__name__}",
            "json_schema",
            "invalid_schema",
        )
    for path, node in _subschemas(schema):
        _check_node(path, node)


def check_structural_tag(text: str) -> None:
    """A structural tag is JSON whose `json_schema` formats are checked as `check_json_schema`
    checks a schema (errors under the structural_tag param)."""
    try:
        tag = json.loads(text)
    except (RecursionError, ValueError) as exc:
        raise InvalidRequest(
            f"structural_tag is not valid JSON: {exc}", "structural_tag", "invalid_json"
        ) from None
    if _depth(tag) > MAX_JSON_DEPTH + _TAG_NESTING:
        raise InvalidRequest("the structural_tag nests too deep", "structural_tag", "schema_too_deep")
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                try:
                    check_json_schema(json.dumps(node["json_schema"]))
                except InvalidRequest as exc:
                    raise InvalidRequest(exc.message, "structural_tag", exc.code) from None
            else:
                stack.extend(node.values())


def _too_deep() -> InvalidRequest:
    return InvalidRequest(
        f"the json_schema nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
        "json_schema",
        "schema_too_deep",
    )


def _depth(value: Any) -> int:
    """Nesting depth of objects and arrays (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node)
    return deepest


def _unsupported(path: str, what: str) -> InvalidRequest:
    return InvalidRequest(
        f"unsupported JSON schema feature at {path}: {what}", "json_schema", "unsupported_schema_feature"
    )


def _check_node(path: str, node: dict[str, Any]) -> None:
    for key in _IGNORED_KEYWORDS:
        if key in node:
            raise _unsupported(f"{path}.{key}", f"'{key}' is not supported")
    if node.get("uniqueItems") is True:
        raise _unsupported(f"{path}.uniqueItems", "'uniqueItems: true' is not supported")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise _unsupported(f"{path}.allOf", "'allOf' with more than one subschema is not supported")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise _unsupported(f"{path}.$ref", f"only local references ('#/...') are supported, got {ref!r}")
    patterns = [(f"{path}.pattern", node.get("pattern"))]
    if isinstance(node.get("patternProperties"), dict):
        patterns += [(f"{path}.patternProperties", p) for p in node["patternProperties"]]
    for where, pattern in patterns:
        if isinstance(pattern, str):
            _check_pattern(where, pattern)


def _check_pattern(where: str, pattern: str) -> None:
    # Inside a schema xgrammar only warns about a pattern it cannot enforce and drops it;
    # compiled alone, the same regex fails loudly, which is what we want.
    try:
        xgr.Grammar.from_regex(pattern)
    except RuntimeError as exc:
        message = clean_error(exc)
        if "not supported" in message:
            raise _unsupported(where, message) from None
        raise InvalidRequest(
            f"invalid JSON schema: bad regex at {where}: {message}", "json_schema", "invalid_schema"
        ) from None


def _subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in the tree, parents before children and siblings in order (never
    property names or enum/const values). Iterative: the depth is bounded by the caller, but a
    walk must not depend on the interpreter's recursion limit."""
    stack = [("$", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        children = []
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                children.append((f"{path}.{key}", node[key]))
        for key in _SUBSCHEMA_MAP:
            if isinstance(node.get(key), dict):
                children += [(f"{path}.{key}.{name}", sub) for name, sub in node[key].items()]
        for key in _SUBSCHEMA_LIST:
            if isinstance(node.get(key), list):
                children += [(f"{path}.{key}[{i}]", sub) for i, sub in enumerate(node[key])]
        stack.extend(reversed(children))
