"""An incident report turned into JSON under a schema, parsed and checked."""

from __future__ import annotations

import json
from typing import Any

import radixserve.lang as rl

CATEGORIES = ["network", "database", "storage", "application", "security"]
SEVERITIES = ["low", "medium", "high", "critical"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "category": {"enum": CATEGORIES},
        "severity": {"enum": SEVERITIES},
        "cause": {"type": "string", "maxLength": 120},
        "suggestion": {"type": "string", "maxLength": 120},
    },
    "required": ["category", "severity", "cause", "suggestion"],
    "additionalProperties": False,
}


@rl.function
def extract(s: rl.ProgramState, report: str) -> dict[str, Any]:
    s += rl.system("You classify incident reports. Answer with JSON only.")
    s += rl.user(
        f"Report: {report}\nGive the category ({', '.join(CATEGORIES)}), the severity "
        f"({', '.join(SEVERITIES)}), the cause and a suggestion."
    )
    s += rl.assistant(rl.gen("incident", max_tokens=160, json_schema=SCHEMA))
    return check(json.loads(s["incident"]))


def check(obj: Any) -> dict[str, Any]:
    """The incident as the schema has it; ValueError otherwise."""
    if not isinstance(obj, dict) or set(obj) != set(SCHEMA["required"]):
        raise ValueError(f"not an incident: {obj!r}")
    if obj["category"] not in CATEGORIES or obj["severity"] not in SEVERITIES:
        raise ValueError(f"category or severity outside the schema: {obj!r}")
    if not all(isinstance(obj[k], str) and len(obj[k]) <= 120 for k in ("cause", "suggestion")):
        raise ValueError(f"cause and suggestion are short strings: {obj!r}")
    return obj


def main(backend: rl.Backend) -> dict[str, Any]:
    report = (
        "At 03:10 the checkout service started timing out. The primary database ran out of "
        "disk space after the nightly log job filled the volume; writes failed for 40 minutes."
    )
    s = extract.run(report=report, backend=backend, sampling={"temperature": 0})
    return dict(s.ret)


if __name__ == "__main__":
    from radixserve.lang.examples.backends import run_example

    run_example(main, __doc__)
