"""Turn a user's grammar text into an xgrammar `Grammar`, or an `InvalidRequest` that says why not.

Parsing is cheap (no token masks are built), so the HTTP layer can call `parse_grammar` to answer
400 before a request is queued. xgrammar 0.2.9 silently drops some JSON-schema keywords (the
output would then not validate against the schema the user sent), so those are refused here with
the path of the offending keyword instead of being relaxed behind the user's back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import xgrammar as xgr

from radixserve.workers.protocol import InvalidRequest

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")

# The request field each kind came from (OpenAI's `param` in the error body).
PARAM_OF_KIND = {
    "json_schema": "json_schema",
    "json_object": "response_format",
    "regex": "regex",
    "ebnf": "ebnf",
}

# "Any JSON object" for response_format {"type": "json_object"}.
JSON_OBJECT_SCHEMA = '{"type": "object"}'

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


def parse_grammar(kind: str, text: str, any_whitespace: bool = False) -> xgr.Grammar:
    """The xgrammar Grammar for (kind, text); raises InvalidRequest (param, code set) if bad."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    param = PARAM_OF_KIND[kind]
    if kind != "json_object" and not isinstance(text, str):
        raise InvalidRequest(f"'{param}' must be a string", param, "invalid_grammar")
    if kind in ("json_schema", "json_object"):
        schema_text = JSON_OBJECT_SCHEMA if kind == "json_object" else text
        check_json_schema(schema_text)
        build = lambda: xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace)
        what, code = "JSON schema", "invalid_schema"
    elif kind == "regex":
        build = lambda: xgr.Grammar.from_regex(text)
        what, code = "regex", "invalid_regex"
    else:
        build = lambda: xgr.Grammar.from_ebnf(text)
        what, code = "EBNF grammar", "invalid_ebnf"
    try:
        return build()
    except RuntimeError as exc:
        raise InvalidRequest(f"invalid {what}: {clean_error(exc)}", param, code) from None


def check_json_schema(text: str) -> None:
    """Refuse text that is not JSON, not a schema (object or bool), or uses unsupported features."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"json_schema is not valid JSON: {exc}", "json_schema", "invalid_json") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(
            f"a JSON schema must be an object or a boolean, got {type(schema).__name__}",
            "json_schema",
            "invalid_schema",
        )
    for path, node in _subschemas(schema, "$"):
        _check_node(path, node)


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


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in the tree (never property names or enum/const values)."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _SUBSCHEMA:
        if isinstance(node.get(key), dict):
            yield from _subschemas(node[key], f"{path}.{key}")
    for key in _SUBSCHEMA_MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{path}.{key}.{name}")
    for key in _SUBSCHEMA_LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{path}.{key}[{i}]")
