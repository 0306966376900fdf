"""A small agent loop: the model writes a tool call under a JSON schema, Python runs the tool,
the result goes back into the conversation, and the model answers."""

from __future__ import annotations

import json
from typing import Any

import radixserve.lang as rl

TOOLS = {
    "add": lambda a, b: a + b,
    "multiply": lambda a, b: a * b,
}
CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool": {"enum": sorted(TOOLS)},
        "a": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
        "b": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
    },
    "required": ["tool", "a", "b"],
    "additionalProperties": False,
}


@rl.function
def agent(s: rl.ProgramState, task: str, max_steps: int = 2) -> list[dict[str, Any]]:
    s += rl.system(
        "You solve arithmetic with tools. Call a tool with JSON "
        '{"tool": "add" or "multiply", "a": integer, "b": integer}.'
    )
    s += rl.user(task)
    trace = []
    for _ in range(max_steps):
        s += rl.assistant(rl.gen("call", max_tokens=48, json_schema=CALL_SCHEMA))
        call = json.loads(s["call"])
        result = TOOLS[call["tool"]](call["a"], call["b"])
        trace.append({**call, "result": result})
        s += rl.user(f"Tool result: {result}. Is the task done?")
        s += rl.assistant(rl.select("done", ["yes", "no"]))
        if s["done"] == "yes":
            break
        s += rl.user("Call the next tool.")
    s += rl.user("Give the final answer as a number.")
    s += rl.assistant(rl.gen("answer", max_tokens=12, regex="-?[0-9]+"))
    return trace


def main(backend: rl.Backend) -> dict[str, Any]:
    s = agent.run(task="What is 17 multiplied by 23?", backend=backend, sampling={"temperature": 0})
    return {"trace": s.ret, "answer": int(s["answer"])}


if __name__ == "__main__":
    from radixserve.lang.examples.backends import run_example

    run_example(main, __doc__)
