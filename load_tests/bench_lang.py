"""The frontend language's prefix sharing: `run_batch` of programs that share a few-shot preamble
against the same prompts sent as independent requests to an engine without the radix cache.

Both run the prompts concurrently (64 threads) on the default model, offline; the figures are
programs per second, generated tokens per second, and the prompt tokens each computed.

    python -m load_tests.bench_lang [--programs 64] [--max-tokens 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import radixserve.lang as rl

SHOTS = [
    ("The hotel room was spotless and the staff were kind.", "positive"),
    ("Our flight was cancelled twice and nobody told us why.", "negative"),
    ("The museum opens at nine and closes at five.", "neutral"),
    ("The food was cold and the waiter rude.", "negative"),
    ("A stunning view from the balcony, we will be back.", "positive"),
    ("The train leaves from platform four.", "neutral"),
    ("Lost luggage, broken promises, never again.", "negative"),
    ("The guide was funny and knew everything about the old town.", "positive"),
]
PREAMBLE = "Label each travel review as positive, negative or neutral, then explain briefly.\n\n" + "".join(
    f"Review: {t}\nLabel: {label}\n\n" for t, label in SHOTS
)


@rl.function
def review(s: rl.ProgramState, text: str, max_tokens: int) -> None:
    s += PREAMBLE + f"Review: {text}\nLabel:" + rl.gen("label", max_tokens=max_tokens, temperature=0)


def texts(n: int) -> list[str]:
    return [
        f"Trip number {i}: the {['bus', 'ferry', 'hostel', 'tour'][i % 4]} was {i % 7} hours late."
        for i in range(n)
    ]


def measure(engine: Any, run: Any) -> dict[str, Any]:
    before = engine.stats()
    t0 = time.perf_counter()
    generated = run()
    wall = time.perf_counter() - t0
    deadline = time.monotonic() + 30
    while engine.core.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    after = engine.stats()
    return {
        "wall_s": round(wall, 2),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / wall, 1),
        "prompt_tokens": after["prompt_tokens_total"] - before["prompt_tokens_total"],
        "prefill_tokens_computed": after["computed_tokens_total"] - before["computed_tokens_total"],
    }


def bench_lang(n: int, max_tokens: int) -> dict[str, Any]:
    backend = rl.EngineBackend.start(max_running_requests=n)
    try:

        def run() -> int:
            states = review.run_batch(
                [{"text": t, "max_tokens": max_tokens} for t in texts(n)], backend=backend, num_threads=n
            )
            return sum(s.meta("label").usage[0].completion_tokens for s in states)

        return measure(backend.engine, run)
    finally:
        backend.shutdown()


def bench_independent(n: int, max_tokens: int) -> dict[str, Any]:
    from radixserve.workers import Engine

    engine = Engine(max_running_requests=n, disable_radix_cache=True)
    prompts = [PREAMBLE + f"Review: {t}\nLabel:" for t in texts(n)]
    try:

        def one(p: str) -> int:
            return int(
                engine.generate(p, {"max_new_tokens": max_tokens, "temperature": 0})["meta_info"][
                    "completion_tokens"
                ]
            )

        def run() -> int:
            with ThreadPoolExecutor(max_workers=n) as pool:
                return sum(pool.map(one, prompts))

        return measure(engine, run)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--programs", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json")
    args = p.parse_args(argv)
    out = {
        "programs": args.programs,
        "run_batch_shared_preamble": bench_lang(args.programs, args.max_tokens),
        "independent_no_radix_cache": bench_independent(args.programs, args.max_tokens),
    }
    a, b = out["run_batch_shared_preamble"], out["independent_no_radix_cache"]
    out["speedup"] = round(b["wall_s"] / a["wall_s"], 2)
    out["prefill_ratio"] = round(a["prefill_tokens_computed"] / b["prefill_tokens_computed"], 3)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
