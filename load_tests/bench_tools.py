"""Tool calls under their grammar, and the prefix cache across an agent loop, on one engine.

1. Throughput: the same chat prompts (the default model's template, the Hermes convention) with a
   named tool_choice (the call generated under its structural tag, ending when the call closes)
   against plain generation of the same number of tokens (ignore_eos), tokens per second.
2. Agent loop: turn 1 (system prompt, tools, question) makes a call; turn 2 sends the call and
   its result back: how many of turn 2's prompt tokens come from the radix cache (all of turn
   1's prompt should).

    python -m load_tests.bench_tools [--requests 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from radixserve.router.frontend.chat_template import ChatTemplate
from radixserve.router.frontend.schemas import ChatCompletionRequest
from radixserve.router.frontend.tool_parsers import parse_all
from radixserve.router.frontend.tool_requests import plan_tools, template_knows_tools

SYSTEM = "You are a travel assistant. Answer briefly, and call a function when it helps."
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "book_hotel",
            "description": "Book a room",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}},
                "required": ["city", "nights"],
            },
        },
    },
]
CITIES = ["Paris", "Oslo", "Rome", "Lima", "Cairo", "Tokyo", "Quito", "Dakar"]


def prompt(chat: ChatTemplate, messages: list[dict], **fields) -> tuple[list[int], dict, object]:
    """(prompt ids, the tool sampling params, the plan) of one chat request."""
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "system", "content": SYSTEM}, *messages], "tools": TOOLS, **fields}
    )
    plan, rendered = plan_tools(req, "hermes", template_knows_tools(chat.hf.chat_template))
    assert plan is not None
    params = {"structural_tag": plan.grammar} if plan.grammar else {}
    return chat.encode(rendered, tools=plan.tools), params, plan


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]} (trip {i})?"}]


def timed(engine, ids, params):
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    return outs, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from radixserve.workers import Engine

    engine = Engine(max_total_tokens=32768)
    chat = ChatTemplate(engine.tokenizer)
    named = {"type": "function", "function": {"name": "get_weather"}}
    built = [prompt(chat, question(i), tool_choice=named) for i in range(args.requests)]
    ids = [b[0] for b in built]
    grammar = built[0][1]["structural_tag"]
    call = {"max_new_tokens": 128, "temperature": 0, "structural_tag": grammar}
    res: dict = {"requests": args.requests, "prompt_tokens": sum(map(len, ids)) / len(ids)}
    timed(engine, ids[:1], call)  # compile the grammar once (cached) and warm up
    engine.flush_cache()
    outs, dt = timed(engine, ids, call)
    tokens = [o["meta_info"]["completion_tokens"] for o in outs]
    for o in outs:
        parsed = parse_all(built[0][2].parser(), o["text"])
        assert len(parsed.calls) == 1 and json.loads(parsed.calls[0].arguments), o["text"]
    res["constrained"] = {"seconds": dt, "tokens": sum(tokens), "tok_s": sum(tokens) / dt}
    same_len = round(sum(tokens) / len(tokens))
    engine.flush_cache()
    free = {"max_new_tokens": same_len, "temperature": 0, "ignore_eos": True}
    outs, dt = timed(engine, ids, free)
    n = sum(o["meta_info"]["completion_tokens"] for o in outs)
    res["unconstrained"] = {"seconds": dt, "tokens": n, "tok_s": n / dt}
    res["constrained_over_unconstrained"] = res["constrained"]["tok_s"] / res["unconstrained"]["tok_s"]
    print("constrained", res["constrained"], "\nunconstrained", res["unconstrained"], flush=True)

    # The agent loop: turn 1 calls, turn 2 carries the call and its result.
    engine.flush_cache()
    turn1_ids, params, plan = prompt(chat, question(0), tool_choice=named)
    (out1,) = engine.generate(
        input_ids=[turn1_ids], sampling_params={"max_new_tokens": 128, "temperature": 0, **params}
    )
    parsed = parse_all(plan.parser(), out1["text"])
    (c,) = parsed.calls
    history = [
        *question(0),
        {"role": "assistant", "content": None, "tool_calls": [c.to_dict()]},
        {"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "sunny", "high_c": 24}'},
    ]
    turn2_ids, params, _ = prompt(chat, history, tool_choice="auto")
    (out2,) = engine.generate(
        input_ids=[turn2_ids], sampling_params={"max_new_tokens": 32, "temperature": 0, **params}
    )
    meta = out2["meta_info"]
    res["agent_loop"] = {
        "turn1_prompt_tokens": len(turn1_ids),
        "turn2_prompt_tokens": meta["prompt_tokens"],
        "turn2_cached_tokens": meta["cached_tokens"],
        "turn2_prefix_shared_with_turn1": _common_prefix(turn1_ids, turn2_ids),
    }
    print("agent loop", res["agent_loop"], flush=True)
    engine.shutdown()
    print(
        f"\nconstrained tool calls / plain generation throughput: {res['constrained_over_unconstrained']:.2f}"
    )
    loop = res["agent_loop"]
    print(
        f"turn 2: {loop['turn2_cached_tokens']} of {loop['turn2_prompt_tokens']} prompt tokens cached "
        f"(turn 1's prompt: {loop['turn1_prompt_tokens']})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


if __name__ == "__main__":
    sys.exit(main())
