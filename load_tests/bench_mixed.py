"""Long prompts arriving while others decode: the decodes' inter-token latency, mixed steps on/off.

Workload: --decoders streams of --decode-prompt tokens decode --decode-out tokens each (greedy,
ignore_eos); once they all decode, --long prompts of --long-prompt tokens arrive, one every
--gap-s, each with --long-out output tokens. Measured per mode (`enable_mixed_chunk` off, the
default; on with the whole chunk per step; on with --mixed-step-ratio bounding a mixed step's time),
on an engine of its own (one at a time: two engines in one process throttle each other's OpenMP
teams), --repeats rounds alternating which mode goes first:
  itl p50 / p99 / max  the decoding streams' gaps between chunks (ms), over the whole run
  p99/p50              the tail ratio the scheduler makes (the target: <= 3)
  ttft                 the long prompts' time to first token (median, ms)
  wall                 the whole workload (s)
The tokens of every stream are compared with mixed off's (greedy: they should agree; a
difference is reported, as bf16 kernels of the two step kinds may round apart).

    python -m load_tests.bench_mixed                      # ~3 minutes on 2 cores
    python -m load_tests.bench_mixed --repeats 3 --json results/mixed.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from load_tests.bench_offline import random_workload


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream(engine: Any, ids: list[int], out: int, t0: float) -> tuple[list[float], list[int]]:
    """Arrival times (s since t0) of the stream's chunks, and its tokens."""
    from radixserve.workers.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True)
    times, tokens = [], []
    async for chunk in engine.submit(GenerateRequest(ids, params, stream=True)):
        if chunk.token_ids:
            times.append(time.perf_counter() - t0)
            tokens.extend(chunk.token_ids)
    return times, tokens


async def workload(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    tok = engine.tokenizer
    decode_prompts = random_workload(tok, args.decoders, args.decode_prompt, seed=11)
    long_prompts = random_workload(tok, args.long, args.long_prompt, seed=12)
    t0 = time.perf_counter()
    decoders = [asyncio.create_task(stream(engine, p, args.decode_out, t0)) for p in decode_prompts]
    while engine.core.num_running() < args.decoders or engine.core.scheduler.waiting:
        await asyncio.sleep(0.005)
    longs = []
    for p in long_prompts:
        longs.append((time.perf_counter() - t0, asyncio.create_task(stream(engine, p, args.long_out, t0))))
        await asyncio.sleep(args.gap_s)
    done = await asyncio.gather(*decoders)
    long_done = [(start, await task) for start, task in longs]
    wall = time.perf_counter() - t0
    # The decoders' gaps once the first long prompt arrived (before it, nothing competes).
    first_long = longs[0][0]
    gaps = [b - a for times, _ in done for a, b in zip(times, times[1:]) if b > first_long]
    return {
        "gaps": gaps,
        "ttft": [times[0] - start for start, (times, _) in long_done],
        "wall": wall,
        "tokens": [t for _, t in done] + [t for _, (_, t) in long_done],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--decode-out", type=int, default=96)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=1500)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=0.3)
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    ap.add_argument("--mixed-step-ratio", type=float, default=2.5, help="the third mode's")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from radixserve.workers import Engine

    modes = {
        "mixed off": {"enable_mixed_chunk": False},
        "mixed, whole chunk": {"enable_mixed_chunk": True, "mixed_step_ratio": 0.0},
        f"mixed, ratio {args.mixed_step_ratio:g}": {
            "enable_mixed_chunk": True,
            "mixed_step_ratio": args.mixed_step_ratio,
        },
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    tokens: dict[str, list[list[int]]] = {}
    for k in range(args.repeats):
        for name in list(modes) if k % 2 == 0 else list(modes)[::-1]:
            engine = Engine(
                args.model_path,
                chunked_prefill_size=args.chunked_prefill_size,
                enable_overlap=False,
                stream_interval_ms=0,  # a chunk per step: the gaps measured are the scheduler's
                **modes[name],
            )
            try:
                engine.generate(input_ids=[[1000, 1001, 1002]], sampling_params={"max_new_tokens": 2})
                r = asyncio.run(workload(engine, args))
                r["mixed_steps"] = engine.stats()["mixed_steps_total"]
            finally:
                engine.shutdown()
            tokens[name] = r.pop("tokens")
            runs[name].append(r)
    report: dict[str, Any] = {}
    for name, rs in runs.items():
        gaps = [g for r in rs for g in r["gaps"]]
        p50, p99 = percentile(gaps, 0.5), percentile(gaps, 0.99)
        row = {
            "itl_p50_ms": round(1000 * p50, 1),
            "itl_p99_ms": round(1000 * p99, 1),
            "itl_max_ms": round(1000 * max(gaps), 1),
            "p99_over_p50": round(p99 / p50, 2),
            "ttft_median_ms": round(1000 * statistics.median(t for r in rs for t in r["ttft"]), 1),
            "wall_s": round(statistics.median(r["wall"] for r in rs), 2),
            "mixed_steps": rs[-1]["mixed_steps"],
        }
        report[name] = row
        print(f"{name:>20}: " + "  ".join(f"{k} {v}" for k, v in row.items()))
    ref = tokens["mixed off"]
    for name in list(modes)[1:]:
        same = sum(a == b for a, b in zip(ref, tokens[name]))
        report[f"streams_identical ({name})"] = f"{same}/{len(ref)}"
        print(f"streams with the same tokens as mixed off ({name}): {same}/{len(ref)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
