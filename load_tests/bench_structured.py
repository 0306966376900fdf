"""Constrained vs unconstrained decoding, side by side in one run, on one engine.

1. Throughput: the same prompts and the same number of output tokens (a regex that cannot end
   before max_new_tokens, and ignore_eos for the free run), constrained vs unconstrained.
2. Jump-forward: a JSON schema with long fixed keys, with jump-forward on vs off (two engines):
   forward steps saved and the wall-time speed-up.

    python -m load_tests.bench_structured [--requests 16] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Letters and spaces, at least 400 characters: with ~4 characters a token it cannot terminate
# before max_new_tokens, so both runs produce exactly the same number of tokens.
LONG_REGEX = r"[a-z ]{400,}"
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_legal_name": {"type": "string", "maxLength": 12},
        "customer_primary_account_identifier": {"type": "integer", "minimum": 0, "maximum": 9999},
        "customer_preferred_contact_channel": {"type": "string", "enum": ["email", "phone"]},
        "customer_is_currently_active_subscriber": {"type": "boolean"},
    },
    "required": [
        "customer_full_legal_name",
        "customer_primary_account_identifier",
        "customer_preferred_contact_channel",
        "customer_is_currently_active_subscriber",
    ],
    "additionalProperties": False,
}


def timed(engine, prompts, params):
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return outs, dt, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from radixserve.workers import Engine

    prompts = [f"Write a short description of place number {i}:" for i in range(args.requests)]
    res = {}
    engine = Engine(max_total_tokens=32768)
    free = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    constrained = dict(free, regex=LONG_REGEX)
    timed(engine, prompts[:1], constrained)  # compile once (cached) and warm up
    for name, params in (
        ("unconstrained", free),
        ("constrained", constrained),
        ("unconstrained_2", free),
        ("constrained_2", constrained),
    ):
        engine.flush_cache()
        _, dt, tokens = timed(engine, prompts, params)
        res[name] = {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt}
        print(name, res[name], flush=True)
    best = lambda k: max(res[k]["tok_s"], res[k + "_2"]["tok_s"])
    res["constrained_over_unconstrained"] = best("constrained") / best("unconstrained")
    engine.shutdown()

    schema_params = {"max_new_tokens": 200, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    for jf in (True, False):
        e = Engine(max_total_tokens=32768, enable_jump_forward=jf)
        timed(e, prompts[:1], schema_params)
        e.flush_cache()
        before = e.stats()
        outs, dt, tokens = timed(e, prompts, schema_params)
        after = e.stats()
        assert all(json.loads(o["text"]) for o in outs)
        res[f"jump_forward_{'on' if jf else 'off'}"] = {
            "seconds": dt,
            "tokens": tokens,
            "forward_steps": after["step_steps"] - before["step_steps"],
            "jump_forward_tokens": after["jump_forward_tokens_total"] - before["jump_forward_tokens_total"],
        }
        print("jump-forward", jf, res[f"jump_forward_{'on' if jf else 'off'}"], flush=True)
        e.shutdown()
    on, off = res["jump_forward_on"], res["jump_forward_off"]
    res["jump_forward_speedup"] = off["seconds"] / on["seconds"]
    res["jump_forward_steps_saved"] = off["forward_steps"] - on["forward_steps"]
    print(f"\nconstrained / unconstrained throughput: {res['constrained_over_unconstrained']:.2f}")
    print(
        f"jump-forward: {on['jump_forward_tokens']} tokens forced, forward steps {off['forward_steps']}"
        f" -> {on['forward_steps']}, speed-up {res['jump_forward_speedup']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
