"""What deterministic mode (batch-invariant kernels, EngineConfig.deterministic) costs: the same
workloads on the default engine and on a deterministic one, side by side in one run.

    python -m load_tests.bench_deterministic                 # ~2 minutes on 2 idle cores
    python -m load_tests.bench_deterministic --scale 0.5 --repeats 2

One engine at a time (two in one process each keep an OpenMP team and throttle each other), the
modes alternating within each round and the order flipping between rounds. A shared machine's
speed drifts by tens of per cent from minute to minute, so the figure that counts is the ratio of
the two modes within one round (run back to back), summarised by its median over the rounds.
Every request samples at temperature 1 with a seed, which is what the mode is for.

Workloads (--scale multiplies the request counts):
  decode_b1    one request, 32-token prompt, 32 tokens out: one row per GEMM
  decode_b16   16 requests, 32-token prompts, 32 out: decode at batch 16
  prefill      8 requests, 256-token prompts, 2 out: prefill-bound
  long_decode  2 requests, 1024-token prompts, 16 out: decode attention over long contexts

Measured on the 2-core dev VM (AVX512-BF16 and AMX; default model, bf16; --threads 1, 3 rounds;
other jobs held the cores throughout, hence the per-CPU-second figures, the steadier ones: on two
threads an OpenMP team whose threads are preempted measures the neighbours), deterministic /
default, median of the per-round ratios, per CPU second (per wall second):
  decode_b1 1.29x (1.28x), decode_b16 1.22x (1.43x), prefill 0.87x (1.09x), long_decode 0.91x (0.90x).
Here the fixed-order GEMM runs on AMX tiles (csrc/gemm_amx.h), faster than the default packed
kernel from a few rows up, which is why decode gains; prefill pays for torch's AMX matmul (what
the default mode uses above the measured crossover) being 5-20% faster at thousands of rows, and
long contexts for the fixed-order decode attention (2.7x the default kernel's time at 1024 keys:
K/V converted to float32 per key block, extend's arithmetic). Where the CPU has no AMX the
fixed-order GEMM is the AVX512-BF16 kernel with 4 chains: run on this machine it measured
prefill 0.20x and long_decode 0.39x per wall second (1 thread, against a default mode with torch's
AMX matmul, and with an earlier, slower fixed-order decode attention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from load_tests.bench_offline import random_workload

MODES = {False: "default", True: "deterministic"}


def workloads(scale: float) -> dict[str, tuple[list[list[int]], int]]:
    n = lambda k: max(1, int(k * scale))
    return {
        "decode_b1": (random_workload(None, 1, 32, seed=11), 32),
        "decode_b16": (random_workload(None, n(16), 32, seed=12), 32),
        "prefill": (random_workload(None, n(8), 256, seed=13), 2),
        "long_decode": (random_workload(None, n(2), 1024, seed=14), 16),
    }


def run(engine, prompts: list[list[int]], out_len: int, prefill: bool) -> tuple[float, float]:
    """Tokens per wall second and per CPU second of this process (output tokens; prompt + output
    tokens for a prefill workload) of one batch, seeded sampling, from a flushed cache. CPU time
    counts only the work the engine did, not the time other jobs held the cores."""
    engine.flush_cache()
    params = [
        {"max_new_tokens": out_len, "temperature": 1.0, "seed": i, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    wall, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    if prefill:
        tokens += sum(len(p) for p in prompts)
    return tokens / wall, tokens / cpu


def bench(args) -> dict[str, Any]:
    from radixserve.workers import Engine

    loads = workloads(args.scale)
    rates: dict[str, dict[bool, list[float]]] = {w: {False: [], True: []} for w in loads}
    cpu_rates: dict[str, dict[bool, list[float]]] = {w: {False: [], True: []} for w in loads}
    decode_ms: dict[bool, list[float]] = {False: [], True: []}
    for k in range(args.repeats):
        for det in (False, True) if k % 2 == 0 else (True, False):
            engine = Engine(
                args.model_path,
                max_total_tokens=args.max_total_tokens,
                max_running_requests=64,
                deterministic=det,
                num_threads=args.threads,
            )
            for name, (prompts, out_len) in loads.items():
                run(engine, prompts[:1], 2, False)  # warm-up
                wall_rate, cpu_rate = run(engine, prompts, out_len, name == "prefill")
                rates[name][det].append(wall_rate)
                cpu_rates[name][det].append(cpu_rate)
                print(
                    f"  round {k + 1} {MODES[det]:>13} {name:>12}: {wall_rate:8.1f} per s, "
                    f"{cpu_rate:8.1f} per CPU s",
                    flush=True,
                )
            ms = engine.stats().get("decode_forward_ms_avg")
            if ms is not None:
                decode_ms[det].append(ms)
            engine.shutdown()
        print(f"round {k + 1}/{args.repeats} done", flush=True)
    res: dict[str, Any] = {"threads": args.threads or torch.get_num_threads(), "rounds": args.repeats}
    for name, by_mode in rates.items():
        unit = "prompt + output tokens" if name == "prefill" else "output tokens"
        res[name] = {"unit": unit}
        for label, table in (("per s", by_mode), ("per CPU s", cpu_rates[name])):
            ratios = [d / b for b, d in zip(table[False], table[True])]
            res[name][label] = {
                **{MODES[m]: v for m, v in table.items()},
                "ratio_per_round": ratios,
                "median_ratio": statistics.median(ratios),
            }
            cells = "  ".join(f"{MODES[m]} {statistics.median(v):8.1f}" for m, v in table.items())
            per_round = " ".join(f"{r:.2f}" for r in ratios)
            print(
                f"{name:>12} {label:>9}: {cells} {unit}; deterministic/default "
                f"{statistics.median(ratios):.2f}x (rounds: {per_round})",
                flush=True,
            )
    for m, v in decode_ms.items():
        if v:
            res[f"{MODES[m]}_decode_forward_ms_avg"] = statistics.median(v)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the request counts")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, each running both modes")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per engine (default: all cores; 1 is steadier where other jobs share them)",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = ap.parse_args(argv)
    res = bench(args)
    if args.json:
        print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
