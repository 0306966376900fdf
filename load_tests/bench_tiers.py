"""The tiered prefix cache on a chat workload whose conversations outgrow the device pool.

C conversations x T turns, each opening with its own S-token system prompt (random vocabulary
words), each turn adding a Q-token question and O generated tokens. The turns go in rounds, every
conversation's first turn together, then every second turn, ...: a conversation comes back only
after all the others passed through the pool, as the users of a chat product do. Three engines in
turn, one run, the same prompts:

  untiered   the device pool of --pool tokens alone (evicted prefixes are recomputed)
  tiered     the same pool, a host tier of --host-gb and a disk tier of --disk-gb beneath it
  unbounded  a pool that holds everything (the ideal the tiers approach)

Reported per engine: prompt tokens computed, wall time, throughput, TTFT p50 of returning turns
(turn 2 on), bytes moved per tier and load seconds per 1k loaded tokens; and the ratios against
the untiered engine and the unbounded ideal.

    python -m load_tests.bench_tiers                      # 24 x 4 turns on a 6,000-token pool
    python -m load_tests.bench_tiers --conversations 8 --pool 2000 --system 300   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from load_tests.bench_offline import words


async def one_turn(engine: Any, ids: list[int], out: int, t0: float) -> tuple[float, list[int], int]:
    """(TTFT in s, generated tokens, cached prompt tokens) of one streamed request."""
    from radixserve.workers.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True)
    ttft, tokens, cached = None, [], 0
    async for chunk in engine.submit(GenerateRequest(ids, params, stream=True)):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        tokens.extend(chunk.token_ids)
        if chunk.finished:
            cached = chunk.cached_tokens
    assert ttft is not None
    return ttft, tokens, cached


async def conversation_rounds(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    history = [words(rng, args.system) for _ in range(args.conversations)]
    questions = [[words(rng, args.question) for _ in range(args.turns)] for _ in history]
    ttft_returning, outputs = [], []
    prompt_tokens = cached_tokens = 0
    start = time.perf_counter()
    for turn in range(args.turns):
        prompts = [h + q[turn] for h, q in zip(history, questions)]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one_turn(engine, p, args.output, t0) for p in prompts))
        for h, p, (ttft, out, cached) in zip(history, prompts, done):
            h[:] = p + out
            outputs.append(out)
            prompt_tokens += len(p)
            cached_tokens += cached
            if turn:
                ttft_returning.append(ttft)
    wall = time.perf_counter() - start
    generated = sum(len(o) for o in outputs)
    return {
        "seconds": round(wall, 2),
        "prompt_tokens": prompt_tokens,
        "computed_tokens": prompt_tokens - cached_tokens,
        "cached_share": round(cached_tokens / prompt_tokens, 3),
        "tokens_per_s": round((prompt_tokens + generated) / wall, 1),
        "ttft_p50_returning_s": round(statistics.median(ttft_returning), 3),
        "outputs": outputs,
    }


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from radixserve.workers import Engine

    conf: dict[str, Any] = dict(dtype=args.dtype, chunked_prefill_size=args.chunk, max_running_requests=64)
    disk_dir = None
    if kind == "unbounded":
        need = args.conversations * (args.system + args.turns * (args.question + args.output))
        conf["max_total_tokens"] = need + 4096
    else:
        conf["max_total_tokens"] = args.pool
    if kind == "tiered":
        disk_dir = tempfile.mkdtemp(prefix="bench-tiers-")
        conf.update(hicache_host_size=args.host_gb, hicache_disk_dir=disk_dir, hicache_disk_size=args.disk_gb)
    engine = Engine(**conf)
    try:
        result = asyncio.run(conversation_rounds(engine, args))
        stats = engine.stats()
    finally:
        engine.shutdown()
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    result["steps"] = stats.get("step_steps", 0)
    result["forward_s"] = round(stats.get("step_forward_s", 0.0), 2)
    result["host_work_s"] = round(stats.get("step_schedule_s", 0.0) + stats.get("step_text_s", 0.0), 2)
    result["tiers"] = {k: v for k, v in stats.items() if k.startswith(("tier_", "kv_host", "kv_disk"))}
    for tier in ("host", "disk"):
        loaded = stats.get(f"tier_{tier}_loaded_tokens", 0)
        if loaded:
            result[f"{tier}_load_ms_per_1k_tokens"] = round(
                1e6 * stats[f"tier_{tier}_load_seconds"] / loaded, 2
            )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=600, help="system prompt tokens per conversation")
    p.add_argument("--question", type=int, default=40)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--pool", type=int, default=6000, help="device pool of the untiered and tiered engines")
    p.add_argument("--host-gb", type=float, default=0.5)
    p.add_argument("--disk-gb", type=float, default=2.0)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)

    results = {kind: run(kind, args) for kind in ("untiered", "tiered", "unbounded")}
    same = results["tiered"].pop("outputs") == results["untiered"].pop("outputs")
    results["unbounded"].pop("outputs")
    base, tiered, ideal = results["untiered"], results["tiered"], results["unbounded"]
    summary = {
        "greedy_outputs_equal_tiered_vs_untiered": same,
        "computed_tokens_tiered_over_ideal": round(
            tiered["computed_tokens"] / max(ideal["computed_tokens"], 1), 3
        ),
        "throughput_tiered_over_untiered": round(tiered["tokens_per_s"] / base["tokens_per_s"], 2),
        "ttft_p50_returning_untiered_over_tiered": round(
            base["ttft_p50_returning_s"] / tiered["ttft_p50_returning_s"], 2
        ),
        "throughput_tiered_over_ideal": round(tiered["tokens_per_s"] / ideal["tokens_per_s"], 2),
    }
    out = {"args": vars(args), "results": results, "summary": summary}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
